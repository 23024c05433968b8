"""Warm-up of one fresh process, with the disk caches' hit/miss counters: run it twice to see
what a second run's warm-up costs (the first fills $FASTSPEC_CACHE/inductor).

    OMP_NUM_THREADS=1 python -m fastspec.graphs.warm_start [method]     # default: ar
"""
import sys
import time

import torch
from torch._dynamo.utils import counters

from fastspec.engine import Engine
from fastspec.model.loader import load_model
from fastspec.sampling import SamplingParams


def main(method: str = "ar") -> None:
    eng = Engine(load_model("smollm2-135m"), backend="compile")
    t0 = time.perf_counter()
    eng.generate(["Hello there, how are you?"], SamplingParams(max_new_tokens=4), method=method,
                 block=None if method == "ar" else 8)
    print(f"{method}: warm-up {eng.last_stats.warmup_s:.1f} s (whole call {time.perf_counter() - t0:.1f} s),"
          f" threads {torch.get_num_threads()}")
    for k in ("aot_autograd", "inductor"):
        print(" ", k, {n: v for n, v in counters[k].items() if "cache" in n})


if __name__ == "__main__":
    main(*sys.argv[1:2])
