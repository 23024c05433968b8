"""Two draft adapters against each other and AR, paired prompt by prompt in one process: on each
prompt AR, LinearSS with adapter A and LinearSS with adapter B run in turn (the order rotated
prompt by prompt), so a drifting machine's speed hits every arm alike; the separate-process
`fastspec bench --adapter ...` runs it replaces differed by more than the adapters did.

    FASTSPEC_DATA=../shared/data/benchmarks python -m fastspec.graphs.adapter_ab \\
        fastspec/adapters/smollm2-135m/draft-attn fastspec/adapters/smollm2-135m/draft \\
        --suite math --limit 5 --max-new-tokens 128 --json results/adapter_pair_1203.json

(results/adapter_pair_1203.json ran before the rename: its `draft` is today's `draft-attn`,
its `draft-mlp` today's default `draft`.)

Per arm: tok/s (all tokens over summed wall times), decode ms per round, τ, ratio to AR, and
whether every request equalled AR token for token (greedy)."""
from __future__ import annotations

import argparse
import os

from rich.console import Console
from rich.table import Table

from fastspec.engine import Engine
from fastspec.evals.runner import environment, load_items, prompt_token_ids
from fastspec.files import write_json
from fastspec.model.loader import load_model
from fastspec.sampling import SamplingParams
from fastspec.weights import apply_weight_precision


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("adapters", nargs=2, help="adapter folders A and B")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--suite", default="math")
    ap.add_argument("--limit", type=int, default=5, help="prompts per benchmark")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--weights", default="fp32", choices=("fp32", "bf16", "int8"),
                    help="precision of the big linear weights (as bench --weights)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    console = Console()
    items = load_items(a.suite, None, None, a.limit, os.environ.get("FASTSPEC_DATA"), a.max_new_tokens, console)
    arms, engines = {}, []
    for adapter in a.adapters:
        loaded = load_model(a.model, adapter=adapter, dflash=None)
        apply_weight_precision(loaded.model, a.weights)
        eng = Engine(loaded, backend="auto")
        engines.append(eng)
        if not arms:
            arms["ar"] = (eng, "ar")
        arms[f"linear:{os.path.basename(os.path.normpath(adapter))}"] = (eng, "linear")
    prompts = prompt_token_ids(engines[0], items)
    with console.status("warming up every arm on every prompt (4 tokens) ..."):
        for eng, method in arms.values():
            for p in prompts:
                eng.generate([p], SamplingParams(max_new_tokens=4), method=method, block=a.block)
    names = list(arms)
    acc = {k: {"tokens": 0, "wall_s": 0.0, "decode_s": 0.0, "rounds": 0, "identical": True} for k in names}
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    for i, p in enumerate(prompts):
        outs = {}
        for k in names[i % len(names):] + names[:i % len(names)]:
            eng, method = arms[k]
            outs[k] = eng.generate([p], params, method=method, block=a.block)[0].token_ids
            s, t = eng.last_stats, acc[k]
            t["tokens"] += s.new_tokens
            t["wall_s"] += s.wall_s
            t["decode_s"] += s.decode_s
            t["rounds"] += s.rounds
        for k in names:
            acc[k]["identical"] &= outs[k] == outs["ar"]
        console.print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{k} {t['tokens'] / t['wall_s']:.1f}" for k, t in acc.items()) + " tok/s", highlight=False)
    ar = acc["ar"]["tokens"] / acc["ar"]["wall_s"]
    rows = {}
    for k, t in acc.items():
        # τ: tokens a round commits (the first token of each request comes from its prefill).
        rows[k] = {"tok_s": t["tokens"] / t["wall_s"], "x_ar": t["tokens"] / t["wall_s"] / ar,
                   "ms_per_round": 1e3 * t["decode_s"] / max(t["rounds"], 1),
                   "tau": (t["tokens"] - len(prompts)) / max(t["rounds"], 1), "identical": t["identical"]}
    table = Table(title=f"LinearSS B={a.block} per adapter, paired prompt by prompt ({len(prompts)} prompts, "
                        f"{a.max_new_tokens} tokens, C=1, greedy)")
    for col in ("arm", "tok/s", "÷ AR", "ms / round", "τ", "= AR"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for k, r in rows.items():
        table.add_row(k, f"{r['tok_s']:.2f}", f"{r['x_ar']:.2f}", f"{r['ms_per_round']:.1f}", f"{r['tau']:.2f}",
                      "yes" if r["identical"] else "NO")
    console.print(table)
    if a.json:
        write_json(a.json, {"environment": environment(engines, a.model),
                            "adapters": a.adapters, "suite": a.suite, "limit": a.limit,
                            "max_new_tokens": a.max_new_tokens, "block": a.block, "arms": rows})
        console.print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
