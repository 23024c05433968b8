"""Paired A/B of decoding methods in one process: the same requests, the arms' runs alternated
(rep 1: A B C ..., rep 2: A B C ...), so a noisy machine's drift hits every arm alike.

    FASTSPEC_DATA=../shared/data/benchmarks python -m fastspec.graphs.method_ab \\
        --arm "libraspec@join_steps=1" --arm "libraspec@join_steps=0" \\
        --arm "bastion@join_steps=1" --arm "bastion@join_steps=0" --concurrency 2,4 \\
        --out results/join_ab_c2c4.json

An arm is a `--method` spec (completed as `fastspec bench` completes it: `recguide` gets the default
block set and survival tables), optionally with `@attr=value` overrides set on the method instance
before each of its runs (arms that share a spec share one instance, so its compiled steps).
Prompts: the first --limit of each --bench (default GSM8K and MATH-500), chat-rendered; greedy;
an arm's run is one `generate` per benchmark, and every run is checked token for token against AR
at the same concurrency. Per arm and C, each rep's tok/s (all benchmarks' tokens over their
summed wall times) and each benchmark's own, per-request tok/s (`fastspec bench`'s definition:
mean over requests of (new_tokens − 1) / (latency − ttft)), τ, tokens per forward, steps per
round, whether every request equalled AR, and per benchmark the method's own report of its last rep where it has one
(RecGuide: Table 3, the profile check, the gate bound)."""
from __future__ import annotations

import argparse
import json

import torch

from fastspec.cli.main import DEFAULT_RECGUIDE_BLOCKS, load_engine, with_recguide_options
from fastspec.evals.data import load_benchmark
from fastspec.evals.prompts import build_messages
from fastspec.evals.report import per_request_rate
from fastspec.graphs import kernels
from fastspec.graphs.profile import device_name
from fastspec.sampling import SamplingParams
from fastspec.weights import PRECISIONS


def parse_arm(arm: str) -> tuple[str, dict]:
    """"libraspec@join_steps=0@widen_joined=1" -> ("libraspec", {"join_steps": 0, "widen_joined": 1})."""
    spec, *sets = arm.split("@")
    attrs = {}
    for s in sets:
        name, _, value = s.partition("=")
        attrs[name] = int(value) if value.lstrip("-").isdigit() else value
    return spec, attrs


def arm_specs(arms: list[str], model: str, as_written: bool = False) -> list[tuple[str, str, dict]]:
    """(arm, method spec, attribute overrides) per arm, each spec completed as `fastspec bench
    --method` completes it (RecGuide: the default block set and the shipped survival tables, a
    spec's own options winning), so "recguide" here is the method users run; as_written: the
    specs as they are (a bare recguide: fixed B=8, no tables).

        ["ar", "recguide@look_by_best=0"] -> [("ar", "ar", {}), ("recguide@look_by_best=0",
            "recguide[blocks=1/4/8/16/32;tables=profiles/...-survival.json]", {"look_by_best": 0})]
    """
    out = []
    for arm in arms:
        spec, attrs = parse_arm(arm)
        if not as_written:
            spec = with_recguide_options(spec, model, adaptive_blocks=DEFAULT_RECGUIDE_BLOCKS)
        out.append((arm, spec, attrs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arm", action="append", required=True, help="method spec[@attr=value...]")
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--bench", default="gsm8k,math500", help="benchmarks, comma-separated")
    ap.add_argument("--limit", type=int, default=4, help="prompts per benchmark")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup-reps", type=int, default=1,
                    help="untimed passes of every arm over every request before the timed reps")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="fp32", choices=PRECISIONS,
                    help="big linear weights' precision (every arm and AR run on the same ones)")
    ap.add_argument("--as-written", action="store_true",
                    help="run the specs exactly as written (a bare recguide: fixed B=8, no tables); "
                         "the commands of runs before 2026-12-03 need it")
    ap.add_argument("--out")
    args = ap.parse_args()
    eng = load_engine(args.model, "float32", "compile", weights=args.weights)
    benches = args.bench.split(",")
    probs = [(b, p) for b in benches for p in load_benchmark(b, limit=args.limit)]
    prompts = [eng.render_chat(build_messages(p)) for _, p in probs]
    groups = {b: [x for x, (bb, _) in zip(prompts, probs) if bb == b] for b in benches}   # one run each
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    arms = arm_specs(args.arm, args.model, args.as_written)
    # Arms of one spec share its instance: before each run every attribute any of them sets is
    # put back to the arm's value or the instance's own, so no override leaks into another arm.
    defaults: dict[str, dict] = {}
    for _, spec, attrs in arms:
        m = eng.method(spec)
        for name in attrs:
            defaults.setdefault(spec, {}).setdefault(name, getattr(m, name))

    def arm_method(spec: str, attrs: dict):
        m = eng.method(spec)
        for name, default in defaults.get(spec, {}).items():
            setattr(m, name, attrs.get(name, default))
        return m

    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        ar = [x.token_ids for x in eng.generate(prompts, params, method="ar", concurrency=c)]
        # Warm every arm before any timing: a short run, then --warmup-reps untimed passes over
        # every request, which reach the steps a short run does not (longer contexts, the
        # partial batches of a draining run, RecGuide's per-block buckets). A step compiled inside
        # a timed run is left out of its wall time, but its C++ build still slows what runs beside it.
        for _, spec, attrs in arms:
            eng.generate(prompts[:c], SamplingParams(max_new_tokens=16), method=arm_method(spec, attrs),
                         concurrency=c)
        for _ in range(args.warmup_reps):
            for _, spec, attrs in arms:
                for group in groups.values():
                    eng.generate(group, params, method=arm_method(spec, attrs), concurrency=c)
        res = {a: {"arm": a, "concurrency": c, "tok_s": [], "per_request_tok_s": [], "tau": [],
                   "tokens_per_forward": [], "steps_per_round": [], "lazy_compiles": [],
                   "identical_to_ar": True,
                   "per_bench": {b: {"tok_s": []} for b in benches}} for a, _, _ in arms}
        for rep in range(args.reps):
            for a, spec, attrs in arms:
                m, r = arm_method(spec, attrs), res[a]
                out, tokens, wall, fwds, steps, rounds, lazy = [], 0, 0.0, 0, 0, 0, 0
                for b, group in groups.items():   # one run per benchmark: its own tok/s
                    out += eng.generate(group, params, method=m, concurrency=c)
                    st = eng.last_stats
                    r["per_bench"][b]["tok_s"].append(round(st.tokens_per_s, 1))
                    tokens, wall, fwds = tokens + st.new_tokens, wall + st.wall_s, fwds + st.request_forwards
                    steps, rounds = steps + st.steps, rounds + st.rounds
                    lazy += st.lazy_compiles          # steps first built inside this timed run
                    if hasattr(m, "report"):             # the method's own report of its last rep
                        r.setdefault("method_report", {})[b] = m.report()
                r["tok_s"].append(round(tokens / max(wall, 1e-9), 1))
                rate = per_request_rate([{"new_tokens": len(o.token_ids), "latency_s": o.latency_s,
                                          "ttft_s": o.ttft_s} for o in out])
                r["per_request_tok_s"].append(round(rate, 1) if rate is not None else None)
                r["tau"].append(round(sum(sum(x.accept_lengths) for x in out)
                                      / max(sum(len(x.accept_lengths) for x in out), 1), 3))
                r["tokens_per_forward"].append(round(tokens / max(fwds, 1), 3))
                r["steps_per_round"].append(round(steps / max(rounds, 1), 3))
                r["lazy_compiles"].append(lazy)
                r["identical_to_ar"] &= [x.token_ids for x in out] == ar
                print(f"C={c} rep {rep + 1} {a}: {r['tok_s'][-1]} tok/s "
                      f"({r['per_request_tok_s'][-1]} per request), tau {r['tau'][-1]}, "
                      f"tok/fwd {r['tokens_per_forward'][-1]}, steps/round {r['steps_per_round'][-1]}, "
                      f"steps built mid-run {lazy}, "
                      f"identical to AR {r['identical_to_ar']}; "
                      + ", ".join(f"{b} {pb['tok_s'][-1]}" for b, pb in r["per_bench"].items()), flush=True)
        for r in res.values():
            r["mean_tok_s"] = round(sum(r["tok_s"]) / len(r["tok_s"]), 1)
            rates = [x for x in r["per_request_tok_s"] if x is not None]
            r["mean_per_request_tok_s"] = round(sum(rates) / len(rates), 1) if rates else None
            for pb in r["per_bench"].values():
                pb["mean_tok_s"] = round(sum(pb["tok_s"]) / len(pb["tok_s"]), 1)
            rows.append(r)
    if args.out:
        env = {"device": device_name("cpu"), "kernel": kernels.kernel_path(),
               "prefetch": kernels.prefetch_summary(args.weights),
               "threads": torch.get_num_threads(), "torch": torch.__version__, "model": args.model,
               "weights": args.weights,
               "prompts": f"first {args.limit} of {', '.join(benches)}",
               "max_new_tokens": args.max_new_tokens, "warmup_reps": args.warmup_reps,
               "command": "python -m fastspec.graphs.method_ab " + " ".join(
                   [f'--arm "{a}"' for a in args.arm]
                   + [f"--bench {args.bench} --concurrency {args.concurrency} --limit {args.limit} "
                      f"--weights {args.weights} --max-new-tokens {args.max_new_tokens} --reps {args.reps} "
                      f"--warmup-reps {args.warmup_reps}" + (" --as-written" if args.as_written else "")])}
        with open(args.out, "w") as f:
            json.dump({"environment": env, "arms": rows}, f, indent=1)


if __name__ == "__main__":
    main()
