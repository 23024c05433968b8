"""Time the kernel's `cache_attention` on its own at decode shapes, against another revision's kernel
source built side by side in the same process (its own op namespace), calls alternated:

    python -m fastspec.graphs.attn_ab --against 3e7eb67 --isa avx512 --out results/attn_ab_avx512.json

Shapes are SmolLM2-135M's (9 query heads over 3 K/V heads of 64) at a context of ~256 committed
columns, 1 to 32 new tokens per row, batch 1 and 4; causal among the new tokens. Per shape: the
best of 6 alternated passes of 150 calls for each side (µs per call) and whether the two outputs
are bit-identical."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time

import torch

from fastspec.graphs import kernels
from fastspec.graphs.profile import device_name

SHAPES = [(1, 1, 264), (1, 8, 264), (1, 16, 272), (1, 32, 288), (4, 8, 264)]   # (batch, new tokens, ctx)


def kernel_source(rev: str) -> str:
    """The kernel's C++ source (`_CPP`) of graphs/kernels.py at git revision `rev`."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = subprocess.run(["git", "-C", repo, "show", f"{rev}:graphs/kernels.py"], check=True,
                          capture_output=True, text=True).stdout
    return re.search(r'_CPP = r"""(.*?)"""', text, re.S).group(1)


def build(source: str, isa: str, tag: str):
    """Build `source` for `isa` under the op namespace fsab_<tag>_<isa>; its cache_attention op."""
    ns = f"fsab_{tag}_{isa}"
    kernels.build(source, isa, ns, prefix=f"fsab_{tag}")
    return getattr(torch.ops, ns).cache_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", required=True, help="git revision whose kernel source is the baseline")
    ap.add_argument("--isa", default=kernels.requested_isa()[0] or "avx2")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", help="results JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = {"before": build(kernel_source(args.against), args.isa, "before"),
           "after": build(kernels._CPP, args.isa, "after")}
    g = torch.Generator().manual_seed(0)
    slots_n, kv, length, d, heads = 4, 3, 512, 64, 9
    cache = torch.randn(2, slots_n, kv, length, d, generator=g)
    rows = []
    for b, n, ctx in SHAPES:
        q = torch.randn(b, n, heads, d, generator=g)
        slots = torch.arange(b)
        mask = torch.ones(b, n, ctx, dtype=torch.bool)
        mask[:, :, ctx - n:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        outs = {t: op(q, cache[0], cache[1], slots, mask) for t, op in ops.items()}
        best = {t: float("inf") for t in ops}
        for _ in range(6):
            for t, op in ops.items():
                for _ in range(20):
                    op(q, cache[0], cache[1], slots, mask)
                t0 = time.perf_counter()
                for _ in range(150):
                    op(q, cache[0], cache[1], slots, mask)
                best[t] = min(best[t], (time.perf_counter() - t0) / 150 * 1e6)
        row = {"batch": b, "tokens": n, "ctx": ctx, "before_us": round(best["before"], 1),
               "after_us": round(best["after"], 1), "speedup": round(best["before"] / best["after"], 2),
               "bit_identical": bool(torch.equal(outs["before"], outs["after"]))}
        rows.append(row)
        print(f"{args.isa} batch {b} tokens {n:2d} ctx {ctx}: {row['before_us']:7.1f} -> {row['after_us']:7.1f} us "
              f"(x{row['speedup']:.2f}), bit-identical {row['bit_identical']}", flush=True)
    if args.out:
        env = {"device": device_name("cpu"), "isa": args.isa, "threads": args.threads,
               "torch": torch.__version__, "against": args.against,
               "command": f"python -m fastspec.graphs.attn_ab --against {args.against} --isa {args.isa}"}
        with open(args.out, "w") as f:
            json.dump({"environment": env, "shapes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
