"""Time the skinny GEMMs of one decode forward on their own: every big linear of a model's shape
(per layer qkv, o, gate_up, down; then the LM head), token rows (1: AR; 8: a B=8 draft or
verify), random weights packed at a precision, called back to back as a forward calls them
(weights streamed from memory, not cache).

    FASTSPEC_ISA=avx2 python -m fastspec.graphs.gemm_seq int8      # fp32 | bf16 | int8
    python -m fastspec.graphs.gemm_seq bf16 8                      # 8 rows
    FASTSPEC_PREFETCH=off python -m fastspec.graphs.gemm_seq fp32 1   # the prefetch pinned off
    python -m fastspec.graphs.gemm_seq fp32,bf16,int8 1,8,16 results/gemm_rows.json   # a grid, JSON

Prints the median and min ms of 20 passes, the weight bytes per second and the FLOP rate against
this machine's fp32 GEMM peak (a large square matmul, graphs/profile.measure_peak_flops): where a
narrow precision stops paying (8+ rows at the FMA peak, whatever the weight bytes). The figures in
the prefetch note in results/README.md come from it (2 threads)."""
import statistics
import sys
import time

import torch

from fastspec.files import write_json
from fastspec.graphs import kernels
from fastspec.model.loader import load_model
from fastspec.weights import int8_scales


def main(precision: str = "fp32", rows: int = 1, model: str = "smollm2-135m", passes: int = 20,
         peak_flops: float | None = None) -> dict:
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
    flops = 2 * rows * sum(o * i for o, i in shapes)
    med = statistics.median(times)
    peak = f", {flops / med / peak_flops:.0%} of the fp32 GEMM peak" if peak_flops else ""
    print(f"{k.path} {precision}, {rows} row(s), {torch.get_num_threads()} threads, "
          f"{kernels.prefetch_summary(precision)}: median {med * 1e3:.2f} ms, "
          f"min {min(times) * 1e3:.2f} ms, {nbytes / med / 1e9:.1f} GB/s of weights, "
          f"{flops / med / 1e9:.0f} GFLOP/s{peak}", flush=True)
    return {"kernel": k.path, "weights": precision, "rows": rows, "median_ms": med * 1e3,
            "min_ms": min(times) * 1e3, "weight_gbs": nbytes / med / 1e9, "gflops": flops / med / 1e9,
            "prefetch": kernels.prefetch_summary(precision)}


if __name__ == "__main__":
    precisions = (sys.argv[1] if len(sys.argv) > 1 else "fp32").split(",")
    row_counts = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1").split(",")]
    out = sys.argv[3] if len(sys.argv) > 3 else None
    peak = None
    if out or len(precisions) * len(row_counts) > 1:
        from fastspec.graphs.profile import device_name, measure_peak_flops
        main(precisions[0], row_counts[0], passes=5)      # kernel built, threads and clocks up
        peak = max(measure_peak_flops(torch.device("cpu"), reps=20) for _ in range(3))
        print(f"{device_name()}: fp32 GEMM peak {peak / 1e9:.0f} GFLOP/s (torch.mm 1024^3, best of 60)")
    runs = [main(p, r, peak_flops=peak) for p in precisions for r in row_counts]
    if out:
        write_json(out, {"device": device_name(), "peak_gflops": peak / 1e9, "threads": torch.get_num_threads(),
                         "command": "python -m fastspec.graphs.gemm_seq " + " ".join(sys.argv[1:]),
                         "runs": runs})
        print(f"wrote {out}")
