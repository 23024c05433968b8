"""A/B of the attention context: rounds attending over the live prefix vs over the whole cache
(`Engine.attention_ctx` patched to return the cache length, the behaviour before), one engine,
the same prompts, AR and LinearSS (B=8) at C=8, two passes each.

    OMP_NUM_THREADS=1 FASTSPEC_DATA=../shared/data/benchmarks python -m fastspec.graphs.ctx_ab 1

The argument is the torch thread count. Results: results/ctx_ab_c8.json (one run)."""
import json
import sys

import torch

from fastspec.model.loader import load_model
from fastspec.engine import Engine
from fastspec.sampling import SamplingParams
from fastspec.evals.data import load_benchmark
from fastspec.evals.prompts import build_messages


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    loaded = load_model("smollm2-135m")
    eng = Engine(loaded, backend="compile")
    probs = []
    for b in ("gsm8k", "mbpp", "gpqa_diamond"):
        probs += load_benchmark(b, limit=8)
    prompts = [eng.render_chat(build_messages(p)) for p in probs]
    params = SamplingParams(max_new_tokens=128)
    orig = Engine.attention_ctx
    out = {}
    for label in ("whole-cache", "live-prefix", "whole-cache", "live-prefix"):
        Engine.attention_ctx = orig if label == "live-prefix" else (lambda self, m, l: self.cache.max_len)
        for method, block in (("ar", None), ("linear", 8)):
            eng.generate(prompts, params, method=method, block=block, concurrency=8)
            st = eng.last_stats
            out.setdefault(f"{label}/{method}", []).append(round(st.tokens_per_s, 2))
            print(label, method, "tok/s", round(st.tokens_per_s, 2), "max_len", eng.cache.max_len,
                  "recompiles", st.recompiles, "lazy", st.lazy_compiles, "warmup", round(st.warmup_s, 1), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
