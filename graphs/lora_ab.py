"""Fused vs per-target LoRA in one process, same prompts as `make bench` (math suite, first 5 each,
128 new tokens, C=1, greedy): LinearSS B=8 tok/s, alternating twice.

    FASTSPEC_DATA=../shared/data/benchmarks python -m fastspec.graphs.lora_ab [ADAPTER_DIR]

Each arm builds a fresh compiled Engine (the fused and per-target steps are different graphs),
warms it on every prompt (4 tokens), then times the full generation. Prints one line per arm and
a JSON of tok/s lists."""
import json
import os
import sys
import time

import torch
from rich.console import Console
from fastspec.engine import Engine
from fastspec.evals.runner import load_items, prompt_token_ids
from fastspec.model.loader import load_model
from fastspec.sampling import SamplingParams


def main() -> None:
    torch.set_num_threads(2)
    adapter = sys.argv[1] if len(sys.argv) > 1 else "auto"
    items = load_items("math", None, None, 5, os.environ["FASTSPEC_DATA"], 128, Console(stderr=True))
    loaded = load_model("smollm2-135m", adapter=adapter, dflash=None)
    model = loaded.model
    fused = {id(b): (b.attn.fused, b.mlp.fused) for b in model.layers}

    def set_fused(on):
        for b in model.layers:
            b.attn.fused, b.mlp.fused = fused[id(b)] if on else (None, None)

    out = {}
    for rep in range(2):
        for on in (True, False):
            set_fused(on)
            eng = Engine(loaded, backend="compile")
            prompts = prompt_token_ids(eng, items)
            p = SamplingParams(max_new_tokens=128)
            eng.generate(prompts, SamplingParams(max_new_tokens=4), method="linear", block=8)  # warm: steps + prefill buckets
            t = time.perf_counter()
            res = eng.generate(prompts, p, method="linear", block=8)
            dt = time.perf_counter() - t
            n = sum(len(c.token_ids) for c in res)
            key = "fused" if on else "per-target"
            out.setdefault(key, []).append(n / dt)
            print(key, rep, round(n / dt, 2), "tok/s", n, "tokens", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
