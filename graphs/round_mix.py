"""Where a planner's decoding time goes at a concurrency: its rounds by kind (AR-only, drafting
only, mixed: drafting requests beside AR requests, which run as two steps everyone waits for)
and its steps by (variant, block, requests), each with its count and mean wall time.

    FASTSPEC_DATA=../shared/data/benchmarks python -m fastspec.graphs.round_mix \\
        --method "ar,d2sd,d2sd@look_by_best=0@price_mixed_rounds=0" --concurrency 4 \\
        --json results/round_mix_c4.json

A method is a `--method` spec, optionally with `@attr=value` overrides set on its instance for its
own runs, each completed as `fastspec bench` completes it (graphs/method_ab.py's arms: a plain
`recguide` gets the default blocks 1/4/8/16/32 and survival tables, not the library's fixed B=8).

Prompts: the first --limit of each --bench, chat-rendered, greedy, --max-new-tokens each; the
benchmarks' prompts run in groups of C (one `generate` per group, the method's counts kept from
group to group as `fastspec bench --interleave 1` keeps them). --reps passes over every method;
the last is reported (the first also builds the steps)."""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict


def round_kind(variants: list[str]) -> str:
    """A round's kind from its steps' variants ("ar": an AR round)."""
    if all(v == "ar" for v in variants):
        return "ar_only"
    return "mixed" if "ar" in variants else "drafting_only"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="ar,d2sd,bastion,libraspec")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--bench", default="gsm8k,math500,aime25")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import torch

    from fastspec.cli.main import load_engine
    from fastspec.evals.data import load_benchmark
    from fastspec.evals.prompts import build_messages
    from fastspec.evals.runner import split_methods
    from fastspec.graphs import kernels
    from fastspec.graphs.method_ab import arm_specs
    from fastspec.graphs.profile import device_name
    from fastspec.sampling import SamplingParams

    eng = load_engine(a.model, "float32", "auto")
    prompts = [eng.encode(eng.render_chat(build_messages(p)))
               for b in a.bench.split(",") for p in load_benchmark(b, limit=a.limit)]
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    C = a.concurrency
    steps_run: list[tuple] = []          # (round, start, seconds, variant, block, requests)
    run_group = eng.run_group

    def timed_group(meth, plan, slots, blocks, concurrency, longest=None):
        t0 = time.perf_counter()
        out = run_group(meth, plan, slots, blocks, concurrency, longest)
        # AR's own rounds have no variant name; a planner's plain AR rounds are "ar".
        variant = plan.variant or ("ar" if meth.name == "ar" else "draft")
        steps_run.append((eng.stats.rounds, t0, time.perf_counter() - t0, variant, plan.block, len(slots)))
        return out
    eng.run_group = timed_group

    report = {"environment": {"device": device_name("cpu"), "kernel": kernels.kernel_path(),
                              "threads": torch.get_num_threads(), "concurrency": C,
                              "benches": a.bench, "limit": a.limit, "max_new_tokens": a.max_new_tokens},
              "methods": {}}
    arms = arm_specs(split_methods(a.method), a.model)
    for rep in range(a.reps):
        for method, spec, attrs in arms:
            m = eng.method(spec)
            saved = {name: getattr(m, name) for name in attrs}
            for name, value in attrs.items():
                setattr(m, name, value)
            kinds: dict = defaultdict(lambda: [0, 0.0])
            steps: dict = defaultdict(lambda: [0, 0.0])
            decode_s, tokens = 0.0, 0
            for g in range(0, len(prompts), C):
                steps_run.clear()
                eng.generate(prompts[g:g + C], params, method=m, concurrency=C, keep_counts=g > 0)
                decode_s += eng.last_stats.decode_s
                tokens += eng.last_stats.new_tokens
                by_round: dict = defaultdict(list)
                for r, t0, dt, variant, block, n in steps_run:
                    by_round[r].append((t0, dt, variant, block, n))
                rounds = sorted(by_round)
                for i, r in enumerate(rounds):
                    group = by_round[r]
                    # A round runs from its first step to the next round's first (host work included).
                    end = by_round[rounds[i + 1]][0][0] if i + 1 < len(rounds) else group[-1][0] + group[-1][1]
                    k = kinds[round_kind([v for _, _, v, _, _ in group])]
                    k[0] += 1
                    k[1] += end - group[0][0]
                    for _, dt, variant, block, n in group:
                        s = steps[f"{variant} block {block} x{n}"]
                        s[0] += 1
                        s[1] += dt
            for name, value in saved.items():
                setattr(m, name, value)
            if rep < a.reps - 1:
                continue
            row = {"tokens": tokens, "decode_s": round(decode_s, 3), "tokens_per_s": round(tokens / decode_s, 1),
                   "rounds": {k: {"n": n, "s": round(t, 3), "mean_ms": round(1e3 * t / n, 2)}
                              for k, (n, t) in kinds.items()},
                   "steps": {k: {"n": n, "mean_ms": round(1e3 * t / n, 2)}
                             for k, (n, t) in sorted(steps.items(), key=lambda kv: -kv[1][1])}}
            report["methods"][method] = row
            print(f"{method} C={C}: {tokens} tokens, {row['tokens_per_s']} tok/s")
            for k, v in row["rounds"].items():
                print(f"   {k:14s} {v['n']:4d} rounds, {v['s']:6.2f} s, {v['mean_ms']:7.2f} ms a round")
            for k, v in list(row["steps"].items())[:6]:
                print(f"   step {k:24s} {v['n']:4d} x {v['mean_ms']:7.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    import sys

    from fastspec.config import FastspecError
    try:
        main()
    except FastspecError as e:          # an unknown method, a bad option: one line, not a traceback
        sys.exit(f"round_mix: {e}")
