"""Prefill time of the compiled CPU step for the `fastspec speed` prompts (median of 7 after a warm call).

    python -m fastspec.graphs.prefill_time --weights bf16

Run it from two checkouts to compare them (results/prefill_exact_zen4.json: power-of-two prompt
buckets against the prompt's own length, processes alternated old/new/old/new).
"""
from __future__ import annotations

import argparse
import statistics


def main(argv=None) -> None:
    from fastspec.engine import Engine
    from fastspec.evals.speed import PROMPTS
    from fastspec.model.loader import load_model
    from fastspec.sampling import SamplingParams
    from fastspec.weights import apply_weight_precision

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="fp32", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--prompts", type=int, default=2, help="how many of the speed prompts")
    a = ap.parse_args(argv)
    loaded = load_model(a.model)
    apply_weight_precision(loaded.model, a.weights)
    engine = Engine(loaded)
    for text in PROMPTS[: a.prompts]:
        prompt = [engine.render_chat([{"role": "user", "content": text}])]
        engine.generate(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True), concurrency=1)
        ms = []
        for _ in range(7):
            engine.generate(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True), concurrency=1)
            ms.append(engine.last_stats.prefill_s * 1e3)
        print(f"prompt of {len(engine.encode(prompt[0]))} tokens: prefill median {statistics.median(ms):.1f} ms, "
              f"min {min(ms):.1f} ms", flush=True)


if __name__ == "__main__":
    main()
