"""Time the skinny GEMMs of one decode forward on their own: every big linear of a model's shape
(per layer qkv, o, gate_up, down; then the LM head), token rows (1: AR; 8: a B=8 draft or
verify), random weights packed at a precision, called back to back as a forward calls them
(weights streamed from memory, not cache).

    FASTSPEC_ISA=avx2 python -m fastspec.graphs.gemm_seq int8      # fp32 | bf16 | int8
    FASTSPEC_ISA=amx python -m fastspec.graphs.gemm_seq bf16 8     # 8 rows
    FASTSPEC_PREFETCH=off python -m fastspec.graphs.gemm_seq fp32 1   # the prefetch pinned off

Prints the median and min ms of 20 passes and the weight bytes per second; the figures in the
prefetch note in results/README.md come from it (2 threads)."""
import statistics
import sys
import time

import torch

from fastspec.graphs import kernels
from fastspec.model.loader import load_model
from fastspec.weights import int8_scales


def main(precision: str = "fp32", rows: int = 1, model: str = "smollm2-135m", passes: int = 20) -> None:
    k = kernels.active()
    if k is None:
        raise SystemExit("no skinny-GEMM kernel on this machine")
    cfg = load_model(model).cfg
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = [(qkv, h), (h, cfg.num_heads * cfg.head_dim), (2 * inter, h), (h, inter)] * cfg.num_layers
    shapes.append((cfg.vocab_size, h))
    # The prefetch policy a run would use (FASTSPEC_PREFETCH=rule|on|off pins it).
    kernels.tune_prefetch(k, precision, shapes)
    g = torch.Generator().manual_seed(0)
    packed = []
    for out_f, in_f in shapes:
        w = torch.randn(out_f, in_f, generator=g)
        panels, scales = k.pack(w, precision, int8_scales(w) if precision == "int8" else None)
        packed.append((panels, scales, out_f, in_f))
    xs = {i: torch.randn(rows, i, generator=g) for _, i in shapes}

    def forward():
        for panels, scales, out_f, in_f in packed:
            k.linear(xs[in_f], panels, scales, out_f)

    for _ in range(3):
        forward()
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        forward()
        times.append(time.perf_counter() - t0)
    nbytes = sum(p.numel() * p.element_size() for p, *_ in packed)
    med = statistics.median(times)
    print(f"{k.path} {precision}, {rows} row(s), {torch.get_num_threads()} threads, "
          f"{kernels.prefetch_summary(precision)}: median {med * 1e3:.2f} ms, "
          f"min {min(times) * 1e3:.2f} ms, {nbytes / med / 1e9:.1f} GB/s of weights")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fp32", int(sys.argv[2]) if len(sys.argv) > 2 else 1)
