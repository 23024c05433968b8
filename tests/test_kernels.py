"""The skinny-GEMM kernel on every ISA this CPU runs, at every weight precision; the ISA switch; the
fallback; low-precision weights keep self-speculation lossless against AR on the same weights."""
import os
import platform
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_drafter, tiny_loaded, random_token_prompts
from fastspec.config import FastspecError
from fastspec.engine import Engine
from fastspec.graphs import kernels
from fastspec.graphs.compile import _pack_model
from fastspec.sampling import SamplingParams
from fastspec.weights import (PRECISIONS, apply_weight_precision, big_linear_weights, int8_scales,
                              round_int8, weight_precision)

ISAS = kernels.cpu_isas()
needs_kernel = pytest.mark.skipif(not ISAS, reason="no kernel ISA on this CPU")


@pytest.fixture
def isa_env(monkeypatch):
    """FASTSPEC_ISA set inside the test; the process's kernel choice is re-read before and after."""
    kernels.active.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    kernels.active.cache_clear()


def rounded_weight(out_features: int, in_features: int, precision: str, g: torch.Generator):
    """A random [out, in] weight holding exactly `precision`'s values, and its int8 scales."""
    w = torch.randn(out_features, in_features, generator=g)
    w[0] *= 10                                  # rows of different scales
    if precision == "bf16":
        return w.bfloat16().float(), None
    if precision == "int8":
        s = int8_scales(w)
        return round_int8(w, s), s
    return w, None


# --- the kernel -------------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_equals_x_at_w_transposed(isa, precision):
    """Every row count 1..16 (whole and partial micro-tiles) against ragged out-features (a last
    panel of 1..panel-1 columns) and odd in-features: y = x @ W^T with W the dequantized weight,
    to fp32 accumulation error."""
    k = kernels.load(isa)
    g = torch.Generator().manual_seed(0)
    for out_features, in_features in [(1, 1), (5, 7), (k.panel, 64), (k.panel + 1, 33), (100, 130),
                                      (3 * k.panel - 3, 96), (20, 300)]:
        w, s = rounded_weight(out_features, in_features, precision, g)
        panels, scales = k.pack(w, precision, s)
        assert panels.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[precision]
        assert panels.shape == (-(-out_features // k.panel), in_features, k.panel)
        for rows in range(1, 17):
            x = torch.randn(rows, in_features, generator=g)
            y = k.linear(x, panels, scales, out_features)
            ref = x.double() @ w.double().T
            bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
            assert y.shape == (rows, out_features) and y.dtype == torch.float32
            assert ((y.double() - ref).abs() <= bound).all(), (isa, precision, out_features, in_features, rows)
    # Leading dims are kept, a non-contiguous input is read correctly.
    w, s = rounded_weight(40, 24, precision, g)
    panels, scales = k.pack(w, precision, s)
    x = torch.randn(3, 24, 5, generator=g).transpose(1, 2)
    torch.testing.assert_close(k.linear(x, panels, scales, 40), x @ w.T, rtol=1e-5, atol=1e-5)
    # Threads split the panels, never a sum: the same bits on 1 thread and on 2.
    w, s = rounded_weight(300, 200, precision, g)
    panels, scales = k.pack(w, precision, s)
    x = torch.randn(13, 200, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = k.linear(x, panels, scales, 300)
        torch.set_num_threads(2)
        assert torch.equal(k.linear(x, panels, scales, 300), one)
    finally:
        torch.set_num_threads(threads)


def block_diagonal_b(parts: list[tuple[int, int]], g: torch.Generator) -> torch.Tensor:
    """A fused LoRA's B: [Σ rows, Σ rank], block-diagonal over (rows, rank) parts (rank 0: a part
    without LoRA), like FusedLoRA's q/k/v B."""
    b = torch.zeros(sum(r for r, _ in parts), sum(k for _, k in parts))
    row = col = 0
    for rows, rank in parts:
        b[row: row + rows, col: col + rank] = torch.randn(rows, rank, generator=g)
        row, col = row + rows, col + rank
    return b


@needs_kernel
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("isa", ISAS)
def test_lora_linear_is_the_three_gemms_it_replaces_bit_for_bit(isa, precision):
    """skinny_lora_linear = skinny(x, W) + skinny(skinny(x, A), B) * gate, the same bits, for
    every row count 1..16, block-diagonal B whose parts straddle panels or skip a part (no LoRA
    on k), gates of 0 and 1 (the seed row runs without the adapter), the LoRA at the precision
    `_pack_model` gives it under these weights (bf16 under bf16 and int8); and to fp32
    accumulation error of x W^T + gate (x A^T) B^T in double, A and B as packed."""
    from fastspec.graphs.compile import lora_precision
    lora = lora_precision(precision)
    k = kernels.load(isa)
    g = torch.Generator().manual_seed(1)
    for in_features, parts in [(64, [(k.panel * 2, 8), (k.panel, 0), (k.panel, 8)]),
                               (33, [(k.panel + 5, 4), (2 * k.panel - 3, 12)]),
                               (100, [(7, 3)])]:
        b = block_diagonal_b(parts, g)
        out_features, rank = b.shape
        w, s = rounded_weight(out_features, in_features, precision, g)
        a = torch.randn(rank, in_features, generator=g)
        if lora == "bf16":
            a, b = a.bfloat16().float(), b.bfloat16().float()
        panels, scales = k.pack(w, precision, s)
        a_panels, _ = k.pack(a, lora)
        b_panels, _ = k.pack(b, lora)
        compact, index = k.pack_lora_b(b, lora)
        assert a_panels.dtype == compact.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[lora]
        assert compact.numel() < b_panels.numel() or len(parts) == 1   # the zero blocks are gone
        for rows in range(1, 17):
            x = torch.randn(rows, in_features, generator=g)
            gate = (torch.rand(rows, generator=g) < 0.7).float()
            gate[0] = 0.0
            three = (k.linear(x, panels, scales, out_features)
                     + k.linear(k.linear(x, a_panels, None, rank), b_panels, None, out_features) * gate[:, None])
            one = k.lora_linear(x, panels, scales, out_features, a_panels, compact, index, gate)
            assert torch.equal(one, three), (isa, precision, parts, rows)
            xd, wd, ad, bd = x.double(), w.double(), a.double(), b.double()
            ref = xd @ wd.T + gate.double()[:, None] * ((xd @ ad.T) @ bd.T)
            bound = 1e-5 * (xd.abs() @ wd.abs().T + (xd.abs() @ ad.abs().T) @ bd.abs().T) + 1e-30
            assert ((one.double() - ref).abs() <= bound).all()
    with pytest.raises(RuntimeError, match="gate"):
        k.lora_linear(torch.randn(3, 100), panels, scales, out_features, a_panels, compact, index,
                      torch.ones(2))


@needs_kernel
def test_kernel_refuses_mismatched_panels():
    k = kernels.load(ISAS[0])
    w = torch.randn(20, 8)
    panels, _ = k.pack(w)
    with pytest.raises(RuntimeError, match="packed weight"):
        k.linear(torch.randn(2, 9), panels, None, 20)
    q, s = k.pack(w, "int8", int8_scales(w))
    with pytest.raises(RuntimeError, match="scales"):
        k.linear(torch.randn(2, 8), q, None, 20)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_kv_write_writes_what_the_indexed_assignment_writes(isa):
    """The op a compiled step writes new K/V with: `cache[layer][rows, :, cols] = value`, rows
    [S, 1] and cols [S, n] broadcast against each other (a slot's new columns), in place."""
    k = kernels.load(isa)
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(3, 5, 2, 12, 4, generator=g)         # [layers, slots, heads, len, dim]
    rows = torch.tensor([[3], [0], [4]])
    cols = torch.tensor([[2, 3], [7, 8], [0, 1]])
    value = torch.randn(3, 2, 2, 4, generator=g, dtype=torch.float64)   # cast to the cache's dtype
    want = cache.clone()
    want[1][rows, :, cols] = value.float()
    address = cache.data_ptr()
    k.ops.kv_write_(cache, 1, rows, cols, value)
    assert cache.data_ptr() == address and torch.equal(cache, want)


def test_the_kernel_source_builds_without_torch_extension_h(tmp_path, monkeypatch):
    """The first use on a machine builds the kernel: only the ATen headers its ops use go in (the
    whole of torch's C++ API and pybind11 tripled the build, ~30 s -> ~10 s on 2 cores)."""
    import torch.utils.cpp_extension as ext
    seen = {}

    def fake_load(name, sources, **kw):
        seen.update(name=name, text=open(sources[0]).read(), **kw)

    monkeypatch.setattr(ext, "load", fake_load)
    monkeypatch.setattr(kernels, "_build_dir", lambda: str(tmp_path))
    kernels.build("// a source\n", "avx2", "fastspec_test_ns")
    assert seen["text"] == "// a source\n" and not seen["is_python_module"]
    assert "-DFASTSPEC_NS=fastspec_test_ns" in seen["extra_cflags"]
    includes = [line.split()[1] for line in kernels._CPP.splitlines() if line.startswith("#include")]
    assert "<torch/library.h>" in includes
    assert "<torch/extension.h>" not in includes and "<ATen/ATen.h>" not in includes


def test_a_build_killed_midway_does_not_hang_the_next_one(tmp_path, monkeypatch):
    """torch's extension build waits for as long as a `lock` file sits in its directory; a build
    killed midway leaves one behind. The next build, holding the builders' flock, knows that
    file is a dead builder's and removes it before torch looks."""
    import torch.utils.cpp_extension as ext
    seen = []

    def fake_load(name, sources, build_directory, **kw):
        seen.append(os.path.exists(os.path.join(build_directory, "lock")))

    monkeypatch.setattr(ext, "load", fake_load)
    monkeypatch.setattr(kernels, "_build_dir", lambda: str(tmp_path))
    kernels.build("// a source\n", "avx2", "fastspec_test_ns")
    (directory,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    (directory / "lock").write_text("")                 # what a killed build leaves
    kernels.build("// a source\n", "avx2", "fastspec_test_ns")
    assert seen == [False, False]


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_cache_attention_equals_sdpa_over_the_gathered_slots(isa):
    """The kernel's attention reads each row's slot of the cache in place and gives what SDPA
    gives over the gathered K/V (fastspec/model/llama.py attend_cache): grouped heads, head dims
    that are not a whole number of vectors, ragged masks, a strided layer view of the cache."""
    from fastspec.model.llama import attend_cache
    k = kernels.load(isa)
    g = torch.Generator().manual_seed(0)
    for B, N, H, KV, D, L, ctx in [(1, 1, 9, 3, 64, 40, 33), (3, 5, 4, 2, 40, 20, 20),
                                   (2, 16, 6, 6, 17, 70, 64), (1, 3, 2, 1, 8, 5, 1)]:
        S = B + 2
        cache = torch.randn(2, 2, S, KV, L, D, generator=g)         # [K/V, layers, slots, ...]
        kc, vc = cache[0, 1], cache[1, 1]                           # layer 1: a strided view
        q = torch.randn(B, H, N, D, generator=g).transpose(1, 2)    # not contiguous
        slots = torch.randperm(S, generator=g)[:B]
        mask = torch.rand(B, N, ctx, generator=g) < 0.5
        mask[..., torch.randint(0, ctx, (1,), generator=g)] = True  # no empty row
        out = k.ops.cache_attention(q, kc, vc, slots, mask)
        assert out.shape == (B, N, H * D)
        torch.testing.assert_close(out, attend_cache(q, kc, vc, slots, mask), rtol=1e-5, atol=1e-5)
        # A token's output does not depend on the other rows and tokens sharing its call (bit for
        # bit), wherever it falls among the chunks of queries that share K/V loads.
        for b, n in [(B - 1, N - 1), (0, 0), (0, N // 2)]:
            alone = k.ops.cache_attention(q[b:b + 1, n:n + 1], kc, vc, slots[b:b + 1], mask[b:b + 1, n:n + 1])
            assert torch.equal(alone, out[b:b + 1, n:n + 1])
    # A query that sees no column gets zeros; a slot outside the cache is refused.
    mask[0, 0] = False
    assert not k.ops.cache_attention(q, kc, vc, slots, mask)[0, 0].any()
    with pytest.raises(RuntimeError, match="outside the cache"):
        k.ops.cache_attention(q, kc, vc, torch.tensor([S]), mask)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_cache_attention_chunks_of_queries_change_no_query(isa):
    """SmolLM2's shape (9 heads over 3 K/V heads of 64, whole vectors): at 2 threads the 8 tokens
    x 3 heads of a K/V head go in chunks of several queries that share the K/V loads. Every
    token equals itself computed alone, bit for bit, and a query that sees nothing gets zeros
    without disturbing the others of its chunk."""
    from fastspec.model.llama import attend_cache
    k = kernels.load(isa)
    g = torch.Generator().manual_seed(1)
    B, N, H, KV, D, L, ctx = 2, 8, 9, 3, 64, 48, 40
    cache = torch.randn(2, B + 1, KV, L, D, generator=g)
    q = torch.randn(B, N, H, D, generator=g)
    slots = torch.tensor([2, 0])
    mask = torch.rand(B, N, ctx, generator=g) < 0.7
    mask[..., 0] = True
    mask[1, 5] = False                                 # a query (3 heads) that sees no column
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = k.ops.cache_attention(q, cache[0], cache[1], slots, mask)
        for b in range(B):
            for n in range(N):
                alone = k.ops.cache_attention(q[b:b + 1, n:n + 1], cache[0], cache[1], slots[b:b + 1],
                                              mask[b:b + 1, n:n + 1])
                assert torch.equal(alone, out[b:b + 1, n:n + 1]), (b, n)
    finally:
        torch.set_num_threads(threads)
    assert not out[1, 5].any()
    live = torch.ones(B, N, dtype=torch.bool)
    live[1, 5] = False
    ref = attend_cache(q, cache[0], cache[1], slots, mask)
    torch.testing.assert_close(out[live], ref[live], rtol=1e-5, atol=1e-5)


NEON_HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <vector>
#include "kernel.inc"
static uint32_t rng = 12345;
static float rnd() { rng = rng * 1664525u + 1013904223u; return ((rng >> 8) / 16777216.0f) * 2 - 1; }

// Packs a random weight of `kind` (0 fp32, 1 bf16, 2 int8) the way Kernel.pack does and returns
// the worst |kernel - reference| / sum|x w| over all outputs.
template <typename WT>
double check(int O, int I, int M, int kind) {
  const int nb = (O + PANEL - 1) / PANEL;
  std::vector<float> w(O * I), x(M * I), y(M * O), scale(nb * PANEL, 0.f);
  std::vector<WT> packed(nb * I * PANEL, WT(0));
  for (auto& v : x) v = rnd();
  for (int o = 0; o < O; o++) {
    const float s = 0.01f + 0.02f * (o % 7);
    scale[o] = s;
    for (int i = 0; i < I; i++) {
      float r = rnd();
      WT q{};
      if constexpr (sizeof(WT) == 4) { q = r; w[o * I + i] = r; }
      if constexpr (sizeof(WT) == 2) {
        uint32_t u; std::memcpy(&u, &r, 4); u &= 0xFFFF0000u; std::memcpy(&w[o * I + i], &u, 4);
        q = (WT)(u >> 16);
      }
      if constexpr (sizeof(WT) == 1) { int qi = (int)std::lround(r * 127); w[o * I + i] = s * qi; q = (WT)qi; }
      packed[(o / PANEL) * I * PANEL + i * PANEL + o % PANEL] = q;
    }
  }
  panels<WT>(packed.data(), kind == 2 ? scale.data() : nullptr, x.data(), y.data(), M, I, O, 0, nb);
  double worst = 0;
  for (int m = 0; m < M; m++)
    for (int o = 0; o < O; o++) {
      double ref = 0, mag = 0;
      for (int i = 0; i < I; i++) {
        ref += (double)x[m * I + i] * w[o * I + i];
        mag += std::fabs((double)x[m * I + i] * w[o * I + i]);
      }
      worst = std::max(worst, std::fabs(y[m * O + o] - ref) / (mag + 1e-30));
    }
  return worst;
}

int main() {
  const int shapes[][2] = {{1, 1}, {5, 7}, {16, 64}, {17, 33}, {31, 96}, {100, 130}};
  double worst = 0;
  for (auto& s : shapes)
    for (int M = 1; M <= 16; M++) {
      worst = std::max(worst, check<float>(s[0], s[1], M, 0));
      worst = std::max(worst, check<uint16_t>(s[0], s[1], M, 1));
      worst = std::max(worst, check<int8_t>(s[0], s[1], M, 2));
    }
  std::printf("worst relative error %.3g\n", worst);
  return worst < 1e-5 ? 0 : 1;
}
"""


def run_harness(tmp_path, harness: str, cxx: str, flags: list[str], runner: list[str],
                vec: bool = False) -> str:
    """Builds a torch-free harness around the kernel source (`#include "kernel.inc"`) with
    `cxx flags` and runs it (under `runner`, e.g. qemu); returns its output, failing the test
    on a build error or a non-zero exit. vec: also attention's core, on ATen's header-only vectors."""
    from torch.utils.cpp_extension import include_paths
    (tmp_path / "kernel.inc").write_text(kernels._CPP)
    (tmp_path / "harness.cpp").write_text(harness)
    exe = tmp_path / "harness"
    extra = ["-DFASTSPEC_VEC_ONLY", f"-I{include_paths()[0]}"] if vec else []
    build = subprocess.run([cxx, "-O2", "-std=c++17", "-DFASTSPEC_NO_TORCH", *extra, *flags,
                            str(tmp_path / "harness.cpp"), "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.skipif(not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")),
                    reason="needs aarch64-linux-gnu-g++ and qemu-aarch64")
def test_neon_micro_kernel_under_qemu(tmp_path):
    """The NEON build of the same source (micro-kernels alone, no torch), cross-compiled and run
    under qemu: every precision, rows 1..16, ragged panels, against a double reference."""
    run_harness(tmp_path, NEON_HARNESS, "aarch64-linux-gnu-g++", ["-static", "-DFASTSPEC_ISA_NEON"],
                ["qemu-aarch64"])


@pytest.mark.skipif(not shutil.which("g++") or not set(ISAS) & {"avx512", "avx2"}, reason="needs g++ and x86")
@pytest.mark.parametrize("isa", [i for i in ("avx512", "avx2") if i in ISAS])
def test_micro_kernel_alone_matches_a_double_reference_on_x86(tmp_path, isa):
    """The NEON harness built natively for each x86 ISA this CPU runs (so its packing and
    tolerance are checked without qemu): every precision, rows 1..16, ragged panels."""
    out = run_harness(tmp_path, NEON_HARNESS, "g++", [f"-DFASTSPEC_ISA_{isa.upper()}", *kernels.ISAS[isa].cflags], [])
    assert "worst relative error" in out


ATTENTION_HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>
#include "kernel.inc"
static uint32_t rng = 777;
static float rnd() { rng = rng * 1664525u + 1013904223u; return ((rng >> 8) / 16777216.0f) * 2 - 1; }

// attend() over `threads` pieces, run one after another (the split is what changes with threads:
// the chunk of queries per task; a query's arithmetic must not).
static void call(const float* q, const float* k, const float* v, int64_t slot_stride, const bool* m,
                 const int64_t* sl, float* o, int64_t B, int64_t N, int64_t H, int64_t KV, int64_t L,
                 int64_t D, int64_t ctx, int64_t threads) {
  attend(q, k, v, slot_stride, slot_stride, m, sl, o, B, N, H, KV, L, D, ctx, threads,
         [threads](int64_t n, auto&& body) {
           for (int64_t t = 0; t < threads; t++) {
             const int64_t a = n * t / threads, b = n * (t + 1) / threads;
             if (a < b) body(a, b);
           }
         });
}

// One shape: batched vs a double reference, and every token alone vs batched, bit for bit.
static int check(int64_t B, int64_t N, int64_t H, int64_t KV, int64_t D, int64_t L, int64_t ctx,
                 int64_t threads, double* worst) {
  const int64_t S = B + 1, slot_stride = KV * L * D, G = H / KV;
  std::vector<float> q(B * N * H * D), k(S * slot_stride), v(S * slot_stride), o(B * N * H * D);
  std::vector<int64_t> sl(B);
  std::vector<char> m(B * N * ctx);
  for (auto& x : q) x = 2 * rnd();
  for (auto& x : k) x = rnd();
  for (auto& x : v) x = rnd();
  for (int64_t b = 0; b < B; b++) sl[b] = (b * 2 + 1) % S;
  for (int64_t b = 0; b < B; b++)
    for (int64_t n = 0; n < N; n++)
      for (int64_t c = 0; c < ctx; c++)   // causal-ish, with holes; row (1, N-1) sees nothing
        m[(b * N + n) * ctx + c] = (c <= ctx - N + n) && (rnd() > -0.8f) && !(b == 1 && n == N - 1);
  const bool* mb = reinterpret_cast<const bool*>(m.data());
  call(q.data(), k.data(), v.data(), slot_stride, mb, sl.data(), o.data(), B, N, H, KV, L, D, ctx, threads);
  for (int64_t b = 0; b < B; b++)
    for (int64_t n = 0; n < N; n++) {
      std::vector<float> alone(H * D);
      call(q.data() + (b * N + n) * H * D, k.data(), v.data(), slot_stride, mb + (b * N + n) * ctx,
           sl.data() + b, alone.data(), 1, 1, H, KV, L, D, ctx, threads);
      const float* got = o.data() + (b * N + n) * H * D;
      if (std::memcmp(alone.data(), got, H * D * sizeof(float)) != 0) {
        std::printf("token (%lld, %lld) alone differs from its batched output\n", (long long)b, (long long)n);
        return 1;
      }
      for (int64_t h = 0; h < H; h++) {
        const float* qv = q.data() + ((b * N + n) * H + h) * D;
        const float* K = k.data() + sl[b] * slot_stride + (h / G) * L * D;
        const float* V = v.data() + sl[b] * slot_stride + (h / G) * L * D;
        std::vector<double> p(ctx);
        double mx = -1e300, sum = 0;
        for (int64_t c = 0; c < ctx; c++) {
          if (!mb[(b * N + n) * ctx + c]) continue;
          double s = 0;
          for (int64_t d = 0; d < D; d++) s += (double)qv[d] * K[c * D + d];
          p[c] = s / std::sqrt((double)D);
          mx = std::max(mx, p[c]);
        }
        for (int64_t c = 0; c < ctx; c++)
          sum += p[c] = mb[(b * N + n) * ctx + c] ? std::exp(p[c] - mx) : 0.0;
        for (int64_t d = 0; d < D; d++) {
          double r = 0;
          for (int64_t c = 0; c < ctx; c++) r += p[c] * V[c * D + d];
          r = sum > 0 ? r / sum : 0.0;
          *worst = std::max(*worst, std::fabs(got[h * D + d] - r));
        }
      }
    }
  return 0;
}

int main() {
  // (B, N, H, KV, D, L, ctx): SmolLM2's heads (9 over 3, D 64), a D that is not whole vectors,
  // contexts that are not whole vectors or whole 4-column steps, 1..8 tokens per row.
  const int64_t shapes[][7] = {{2, 1, 9, 3, 64, 48, 37}, {2, 3, 9, 3, 64, 48, 40}, {2, 8, 9, 3, 64, 48, 45},
                               {3, 5, 4, 2, 20, 24, 23}, {2, 2, 6, 1, 8, 16, 9}, {2, 4, 9, 3, 64, 8, 7}};
  double worst = 0;
  for (auto& s : shapes)
    for (int64_t threads = 1; threads <= 3; threads++)
      if (check(s[0], s[1], s[2], s[3], s[4], s[5], s[6], threads, &worst)) return 1;
  std::printf("lanes %d, worst abs error %.3g\n", (int)kLanes, worst);
  return worst < 1e-5 ? 0 : 1;
}
"""


@pytest.mark.skipif("avx2" not in ISAS or not shutil.which("g++"), reason="needs an AVX2 CPU and g++")
def test_attention_core_outside_torch_matches_a_double_reference_and_each_token_alone(tmp_path):
    """The harness the NEON test below runs, checked natively on the AVX2 path, where the torch
    op's own tests also run: the same verdicts from both ways in."""
    out = run_harness(tmp_path, ATTENTION_HARNESS, "g++", ["-DFASTSPEC_ISA_AVX2", *kernels.ISAS["avx2"].cflags],
                      [], vec=True)
    assert out.startswith("lanes 8,")


@pytest.mark.skipif(not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")),
                    reason="needs aarch64-linux-gnu-g++ and qemu-aarch64")
def test_neon_attention_under_qemu(tmp_path):
    """cache_attention's NEON build (4 lanes: its own transposed sums and chunk sizes),
    cross-compiled and run under qemu: a double reference, and every token alone equals its
    batched output bit for bit at 1-3 threads' chunkings."""
    out = run_harness(tmp_path, ATTENTION_HARNESS, "aarch64-linux-gnu-g++", ["-static", "-DFASTSPEC_ISA_NEON"],
                      ["qemu-aarch64"], vec=True)
    assert out.startswith("lanes 4,")


# --- software prefetch: the rule, or what this machine measured -------------------------------
@pytest.mark.parametrize("rule_on, t_off, t_on, expect", [
    (True, 1.00, 1.00, True),     # a tie keeps the rule
    (True, 0.98, 1.00, True),     # 2% faster off: inside the noise margin, keep the rule
    (True, 0.90, 1.00, False),    # 10% faster off: switch
    (False, 1.00, 0.96, True),    # the other way round
    (False, 1.00, 1.20, False),
])
def test_prefetch_switches_only_past_the_noise_margin(rule_on, t_off, t_on, expect):
    assert kernels.keep_or_switch(rule_on, t_off, t_on, margin=0.03) is expect


@needs_kernel
@pytest.mark.parametrize("precision", PRECISIONS)
def test_prefetch_on_or_off_changes_no_bit_of_the_result(precision):
    """The policy only moves data early: 1 row and 8 rows give the same bits either way, and
    set_prefetch reports the setting it replaced."""
    k = kernels.load(ISAS[0])
    wt = {"fp32": 0, "bf16": 1, "int8": 2}[precision]
    g = torch.Generator().manual_seed(3)
    w, s = rounded_weight(3 * k.panel + 5, 700, precision, g)
    panels, scales = k.pack(w, precision, s)
    try:
        for rows in (1, 8, 13):
            x = torch.randn(rows, 700, generator=g)
            multi = int(rows > 1)
            k.ops.set_prefetch(wt, multi, 0)
            off = k.linear(x, panels, scales, w.shape[0])
            assert k.ops.set_prefetch(wt, multi, 1) == 0
            on = k.linear(x, panels, scales, w.shape[0])
            assert k.ops.set_prefetch(wt, multi, -1) == 1
            assert torch.equal(off, on)
        with pytest.raises(RuntimeError, match="set_prefetch"):
            k.ops.set_prefetch(3, 0, 0)
    finally:
        for multi in (0, 1):
            k.ops.set_prefetch(wt, multi, -1)


@needs_kernel
def test_prefetch_is_measured_once_then_read_from_the_cache(monkeypatch, tmp_path):
    """FASTSPEC_PREFETCH=auto: the first use times both settings and writes the choice beside the
    extensions; a new process (the per-process table cleared) reads it back; on/off force it,
    rule keeps the source's rule, anything else is one clear error."""
    k = kernels.load(ISAS[0])
    monkeypatch.setattr(kernels, "_TUNE_BYTES", 1 << 20)           # a fast, meaningless timing
    monkeypatch.setattr(kernels, "_build_dir", lambda: str(tmp_path))
    monkeypatch.setattr(kernels, "_prefetch", {})
    monkeypatch.setenv("FASTSPEC_PREFETCH", "auto")
    monkeypatch.setattr(kernels, "machine_busy_seconds", lambda: None)  # an idle machine, whatever runs beside
    shapes = ((3 * k.panel, 64), (k.panel, 128))
    try:
        first = kernels.tune_prefetch(k, "bf16", shapes)
        assert first["source"] == "measured" and set(first["ms"]) == {
            "1 row, prefetch off", "1 row, prefetch on", "8 rows, prefetch off", "8 rows, prefetch on"}
        assert kernels.tune_prefetch(k, "bf16", shapes) is first          # once per process
        assert (tmp_path / "prefetch.json").exists()
        monkeypatch.setattr(kernels, "_prefetch", {})
        again = kernels.tune_prefetch(k, "bf16", shapes)
        assert again["source"] == "cached" and (again["1"], again["8"]) == (first["1"], first["8"])
        # The kernel now runs with that policy: setting it again reports it.
        assert k.ops.set_prefetch(1, 0, int(first["1"])) == int(first["1"])
        for mode, expect in (("off", False), ("on", True)):
            monkeypatch.setattr(kernels, "_prefetch", {})
            monkeypatch.setenv("FASTSPEC_PREFETCH", mode)
            forced = kernels.tune_prefetch(k, "int8", shapes)
            assert forced == {"1": expect, "8": expect, "source": "forced"}
            assert k.ops.set_prefetch(2, 0, -1) == int(expect) and k.ops.set_prefetch(2, 1, -1) == int(expect)
        monkeypatch.setattr(kernels, "_prefetch", {})
        monkeypatch.setenv("FASTSPEC_PREFETCH", "rule")
        assert kernels.tune_prefetch(k, "fp32", shapes)["source"] == "rule"
        monkeypatch.setattr(kernels, "_prefetch", {})
        monkeypatch.setenv("FASTSPEC_PREFETCH", "sometimes")
        with pytest.raises(FastspecError, match="FASTSPEC_PREFETCH=sometimes: unknown"):
            kernels.tune_prefetch(k, "fp32", shapes)
    finally:
        for wt in range(3):
            for multi in (0, 1):
                k.ops.set_prefetch(wt, multi, -1)


def test_others_share_is_the_cpu_time_other_processes_took():
    # 2 cores for 1 s: 2 CPU-seconds. The machine used 1.8, we used 0.8: others took half of it.
    assert kernels.others_share((10.0, 2), (11.8, 2), 0.8, 1.0) == pytest.approx(0.5)
    assert kernels.others_share((10.0, 2), (10.7, 2), 0.8, 1.0) == 0.0   # jiffy rounding: never negative
    assert kernels.others_share(None, (11.8, 2), 0.8, 1.0) == 0.0         # no /proc/stat: cannot say
    busy = kernels.machine_busy_seconds()
    assert busy is None or (busy[0] > 0 and busy[1] >= 1)


@needs_kernel
def test_a_prefetch_timing_taken_on_a_busy_machine_keeps_the_rule_and_is_not_cached(monkeypatch, tmp_path):
    """Another process took most of the cores while the kernel timed itself: the timing cannot
    be trusted, so the source's rule stays, the header says why, and nothing is written."""
    k = kernels.load(ISAS[0])
    monkeypatch.setattr(kernels, "_TUNE_BYTES", 1 << 20)
    monkeypatch.setattr(kernels, "_build_dir", lambda: str(tmp_path))
    monkeypatch.setattr(kernels, "_prefetch", {})
    monkeypatch.setenv("FASTSPEC_PREFETCH", "auto")
    clock = iter([(0.0, 2), (1e6, 2)])               # every core busy the whole time
    monkeypatch.setattr(kernels, "machine_busy_seconds", lambda: next(clock))
    rule = kernels.prefetch_rule(k, "bf16")
    # ... and the kernel is left on it: resetting again replaces exactly that setting.
    assert rule == {str(r): bool(k.ops.set_prefetch(1, m, -1)) for m, r in enumerate((1, 8))}
    try:
        busy = kernels.tune_prefetch(k, "bf16", ((k.panel, 64),))
        assert (busy["1"], busy["8"]) == (rule["1"], rule["8"])
        assert busy["source"].startswith("rule: ") and "other processes" in busy["source"]
        assert not (tmp_path / "prefetch.json").exists()
    finally:
        for multi in (0, 1):
            k.ops.set_prefetch(1, multi, -1)


# --- choosing the ISA -------------------------------------------------------------------------
@pytest.mark.skipif("avx2" not in ISAS, reason="the CPU does not run AVX2")
def test_forced_isa_picks_the_avx2_kernel(isa_env):
    isa_env.setenv("FASTSPEC_ISA", "avx2")
    assert kernels.kernel_path() == "skinny-avx2"
    assert kernels.active().panel == 16


def test_an_isa_the_cpu_lacks_is_refused(isa_env):
    missing = next(isa for isa in kernels.ISAS if isa not in ISAS)      # x86 lacks neon, arm lacks avx*
    isa_env.setenv("FASTSPEC_ISA", missing)
    with pytest.raises(FastspecError, match=f"FASTSPEC_ISA={missing}: this CPU"):
        kernels.kernel_path()
    isa_env.setenv("FASTSPEC_ISA", "avx1024")
    kernels.active.cache_clear()
    with pytest.raises(FastspecError, match="unknown"):
        kernels.kernel_path()


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 capabilities")
def test_avx512_is_refused_on_an_avx2_cpu(isa_env):
    isa_env.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert kernels.cpu_isas() == ("avx2",)
    isa_env.setenv("FASTSPEC_ISA", "avx512")
    with pytest.raises(FastspecError, match="runs avx2; unset FASTSPEC_ISA or pick avx2|none"):
        kernels.kernel_path()
    isa_env.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    isa_env.delenv("FASTSPEC_ISA")
    assert kernels.requested_isa()[0] is None


def test_fallback_warns_once_and_the_compiled_step_is_still_right(isa_env, capfd):
    """FASTSPEC_ISA=none: one warning line for the whole process, kernel path "fallback", and
    the compiled step (plain inductor GEMMs, no packing) gives the eager logits."""
    from fastspec.graphs.keys import GraphKey
    from fastspec.graphs.profile import forward_inputs, run_environment
    from fastspec.graphs.runner import StepRunner
    isa_env.setenv("FASTSPEC_ISA", "none")
    t = tiny_loaded(seed=4)
    ids, pos, k, v, cols, mask, slots, _ = forward_inputs(t.cfg, 2, 3, "chain", 5, "cpu", torch.float32)
    with torch.no_grad():
        ref = t.model(ids, pos, k.clone(), v.clone(), cols, mask, slots)
    runner = StepRunner("compile", model=t.model)
    for _ in range(2):
        out, = runner.run(GraphKey(2, 3, "chain"), t.model.forward, ids, pos, k.clone(), v.clone(),
                          cols, mask, slots, static=(2, 3))
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert runner._packed == {}
    assert kernels.kernel_path() == "fallback"
    assert run_environment("cpu", torch.float32, "compile")["kernel"] == "fallback"
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("fastspec: ")]
    assert warnings == ["fastspec: no skinny-GEMM kernel (FASTSPEC_ISA=none); compiled CPU steps fall "
                        "back to inductor's GEMM, ~2x slower per decode forward"]


# --- weight precision -------------------------------------------------------------------------
def test_weight_precision_rounds_only_the_big_linears():
    t = tiny_drafter()
    before = {n: p.clone() for n, p in t.model.named_parameters()}
    big = {n for n, _ in big_linear_weights(t.model)}
    assert big == {f"layers.{i}.{w}" for i in range(2)
                   for w in ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")} | {"embed"}
    apply_weight_precision(t.model, "int8")
    assert weight_precision(t.model) == "int8"
    for name, p in t.model.named_parameters():
        if name in big:
            s = t.model.weight_scales[name]
            q = (p / s[:, None]).round()            # w = s[o] * q exactly, q an int8 value
            assert torch.equal(p, q * s[:, None]) and q.abs().max() <= 127
            assert not torch.equal(p, before[name])
            assert (p - before[name]).abs().max() <= s.max() / 2 * (1 + 1e-5)
        else:                                   # norms, LoRA, MASK embedding
            assert torch.equal(p, before[name]), name
    with pytest.raises(FastspecError, match="already rounded to int8"):
        apply_weight_precision(t.model, "fp32")
    with pytest.raises(FastspecError, match="unknown weight precision"):
        apply_weight_precision(t.model, "fp8")

    u = tiny_loaded(tie_word_embeddings=False)
    embed = u.model.embed.clone()
    apply_weight_precision(u.model, "bf16")
    assert "lm_head" in {n for n, _ in big_linear_weights(u.model)}
    assert torch.equal(u.model.lm_head, u.model.lm_head.bfloat16().float())
    assert torch.equal(u.model.embed, embed)   # an untied embedding is a lookup, not a stream


@needs_kernel
@pytest.mark.parametrize("precision", PRECISIONS)
def test_packing_follows_the_model_precision_exactly(precision):
    """The packed panels hold exactly the model's (rounded) weights: kernel, eager and inductor
    steps compute with the same numbers."""
    k = kernels.load(ISAS[0])
    t = tiny_loaded(seed=1)
    apply_weight_precision(t.model, precision)
    packed = _pack_model(t.model, k)
    assert len(packed) == len(big_linear_weights(t.model)) == 4 * 2 + 1
    for _, p in big_linear_weights(t.model):
        pw = packed[id(p)]
        assert pw.panels.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[precision]
        assert torch.equal(k.unpack(pw.panels, pw.scales, pw.out_features), p)


@needs_kernel
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_draft_lora_packs_at_bf16_under_low_precision_weights(precision):
    """The fused LoRA's A and B pack as bf16 (rounded to nearest) under bf16 and int8 weights,
    as fp32 under fp32; B's compact form holds the same numbers as its panels."""
    from fastspec.draft import fuse_adapter
    from fastspec.model.llama import FusedLoRA
    k = kernels.load(ISAS[0])
    t = tiny_drafter()
    apply_weight_precision(t.model, precision)
    fuse_adapter(t.model)
    packed = _pack_model(t.model, k)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    fused = [m for m in t.model.modules() if isinstance(m, FusedLoRA)]
    assert fused
    for m in fused:
        for w in (m.A, m.B):
            pw = packed[id(w)]
            assert pw.panels.dtype == dtype
            assert torch.equal(k.unpack(pw.panels, None, pw.out_features), w.to(dtype).float())
        compact, index = packed[id(m.B)].lora_b
        assert compact.dtype == dtype and index.shape == (-(-m.B.shape[0] // k.panel), 3)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_greedy_linear_equals_ar_with_low_precision_weights(precision):
    t = tiny_drafter()
    apply_weight_precision(t.model, precision)
    engine = Engine(t, backend="eager")
    prompts = random_token_prompts(5, seed=7)
    params = SamplingParams(max_new_tokens=29)
    for concurrency in (1, 3):
        ar = engine.generate(prompts, params, concurrency=concurrency)
        lin = engine.generate(prompts, params, method="linear", block=8, concurrency=concurrency)
        assert [c.token_ids for c in lin] == [c.token_ids for c in ar]


@needs_kernel
def test_compiled_linear_equals_ar_with_int8_weights_through_the_kernel():
    """fastspec's real compile backend: int8 panels in the skinny kernel, inductor around them."""
    t = tiny_drafter()
    apply_weight_precision(t.model, "int8")
    prompts = random_token_prompts(2, seed=3)
    params = SamplingParams(max_new_tokens=20)
    eager_ar = Engine(t, backend="eager").generate(prompts, params, concurrency=2)
    engine = Engine(t, backend="compile")
    ar = engine.generate(prompts, params, concurrency=2)
    lin = engine.generate(prompts, params, method="linear", block=8, concurrency=2)
    packed = engine.runner._packed
    assert packed and all(pw.panels.dtype == torch.int8 for pw in packed.values())
    assert [c.token_ids for c in lin] == [c.token_ids for c in ar] == [c.token_ids for c in eager_ar]


# --- regional compilation -----------------------------------------------------------------------
def _compiled_graph(monkeypatch, regional: str, layers: int = 3, draft: bool = False):
    """Compile one tiny-model step through fastspec's backend with inductor swapped for a recorder:
    returns (the FX graph the backend hands inductor, the step's logits, eager logits, compiles).
    draft: a draft forward of a fused (inference-form) draft adapter instead of a verify one."""
    import torch._inductor.compile_fx as cfx
    from fastspec.graphs.keys import GraphKey
    from fastspec.graphs.profile import forward_inputs
    from fastspec.graphs.runner import StepRunner
    seen = []

    def record(gm, example_inputs, **_):
        seen.append(gm)
        return gm.forward                       # run the rewritten graph as it is (no inductor)

    monkeypatch.setattr(cfx, "compile_fx", record)
    monkeypatch.setenv("FASTSPEC_REGIONAL", regional)
    t = tiny_loaded(seed=2, layers=layers)
    layout = "chain"
    if draft:
        from fastspec.draft import AdapterConfig, attach_adapter, fuse_adapter
        attach_adapter(t.model, AdapterConfig(rank=4, targets=("q", "v", "o", "gate", "up", "down")), seed=2)
        with torch.no_grad():
            for blk in t.model.layers:
                for lora in [*blk.attn.lora.values(), *blk.mlp.lora.values()]:
                    lora.B.normal_(0, 0.1)
        t.model.requires_grad_(False)
        fuse_adapter(t.model)
        layout = "draft"
    ids, pos, k, v, cols, mask, slots, adapter_on = forward_inputs(t.cfg, 2, 3, layout, 5, "cpu",
                                                                   torch.float32, t.model.mask_token_id)
    with torch.no_grad():
        ref = t.model(ids, pos, k.clone(), v.clone(), cols, mask, slots, adapter_on)
    runner = StepRunner("compile", model=t.model)
    out, = runner.run(GraphKey(2, 3, layout), t.model.forward, ids, pos, k, v, cols, mask, slots,
                      adapter_on, static=(2, 3))
    return seen[-1], out, ref, runner.total_compiles()


def _calls(graph: torch.fx.Graph, target) -> list:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def _region_body(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The decoder layer's compiled region (the subgraph every layer calls)."""
    return getattr(gm, _calls(gm.graph, torch.ops.higher_order.invoke_subgraph)[0].args[0].target)


@needs_kernel
def test_a_re_fused_adapter_is_what_the_next_compiled_step_reads(monkeypatch):
    """The kernel packs the fused draft LoRA when a step compiles. Re-fusing builds new tensors of
    the same shapes, which no Dynamo guard notices: the runner must drop its steps and pack again,
    else the draft reads the old adapter. Rounding the weights to a precision packs them again too."""
    import torch._inductor.compile_fx as cfx
    from fastspec.draft import AdapterConfig, attach_adapter, fuse_adapter
    from fastspec.graphs.keys import GraphKey
    from fastspec.graphs.profile import forward_inputs
    from fastspec.graphs.runner import StepRunner
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, example_inputs, **_: gm.forward)   # no inductor
    t = tiny_loaded(seed=2, layers=2)
    attach_adapter(t.model, AdapterConfig(rank=4, targets=("q", "v", "o", "gate", "up", "down")), seed=2)

    def refuse(seed):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for blk in t.model.layers:
                for lora in [*blk.attn.lora.values(), *blk.mlp.lora.values()]:
                    lora.B.copy_(torch.randn(lora.B.shape, generator=g) * 0.3)
        t.model.requires_grad_(False)
        fuse_adapter(t.model)

    ids, pos, k, v, cols, mask, slots, on = forward_inputs(t.cfg, 2, 3, "draft", 5, "cpu", torch.float32,
                                                           t.model.mask_token_id)
    runner = StepRunner("compile", model=t.model)

    def both():
        with torch.no_grad():
            eager = t.model(ids, pos, k.clone(), v.clone(), cols, mask, slots, on)
        out, = runner.run(GraphKey(2, 3, "draft"), t.model.forward, ids, pos, k.clone(), v.clone(),
                          cols, mask, slots, on, static=(2, 3))
        return eager, out

    refuse(1)
    eager1, out1 = both()
    assert torch.allclose(out1, eager1, atol=1e-4) and runner.total_compiles() == 1
    refuse(2)
    eager2, out2 = both()
    assert not torch.allclose(eager2, eager1, atol=1e-2)           # the adapter did change
    assert torch.allclose(out2, eager2, atol=1e-4) and runner.total_compiles() == 2
    both()
    assert runner.total_compiles() == 2                              # and nothing else recompiles
    apply_weight_precision(t.model, "bf16")          # rounded in place: packed again, at bf16
    both()
    assert runner.total_compiles() == 3
    assert all(pw.panels.dtype == torch.bfloat16 for pw in runner._packed.values())


@needs_kernel
def test_two_engines_on_same_shaped_models_never_run_each_others_packed_weights(monkeypatch):
    """Every step of every engine compiles one code object, and its guards skip the weights
    (graphs/runner.skip_weight_guards): a step must still run only the packed panels of its own
    engine's model, called in turns with another engine whose model has the same shapes."""
    import torch._inductor.compile_fx as cfx
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, example_inputs, **_: gm.forward)   # no inductor
    a, b = tiny_loaded(seed=1), tiny_loaded(seed=2)
    prompts = random_token_prompts(2, seed=3)
    params = SamplingParams(max_new_tokens=12)
    want = {name: [c.token_ids for c in Engine(t, backend="eager").generate(prompts, params, concurrency=2)]
            for name, t in (("a", a), ("b", b))}
    assert want["a"] != want["b"]
    engines = {"a": Engine(a, backend="compile"), "b": Engine(b, backend="compile")}
    for _ in range(2):
        for name, engine in engines.items():
            assert [c.token_ids for c in engine.generate(prompts, params, concurrency=2)] == want[name]
    assert all(e.runner._packed for e in engines.values())


@needs_kernel
def test_regional_compilation_traces_one_layer_and_reuses_it(monkeypatch):
    """Every decoder layer calls the same compiled region (one trace, one build, no recompiles
    across layers); the region's four big GEMMs run on the packed panels of the layer calling it."""
    gm, out, ref, compiles = _compiled_graph(monkeypatch, "1", layers=3)
    regions = _calls(gm.graph, torch.ops.higher_order.invoke_subgraph)
    assert len(regions) == 3 and len({r.args[0].target for r in regions}) == 1
    assert compiles == 1
    body = getattr(gm, regions[0].args[0].target)
    skinny = kernels.active().ops.skinny_linear.default
    assert len(_calls(body.graph, skinny)) == 4
    assert not _calls(body.graph, F.linear) and not _calls(body.graph, torch._C._nn.linear)
    assert len(_calls(gm.graph, skinny)) == 1                      # the LM head, outside the layers
    # Attention reads the cache in place through the kernel, never the gathered reference.
    assert len(_calls(body.graph, kernels.active().ops.cache_attention.default)) == 1
    assert not _calls(body.graph, kernels.attention_op())
    # Each layer passes its own panels: 3 layers x 4 weights + the head, all different tensors.
    panels = {id(r.args[-4:][i]) for r in regions for i in range(4)}
    assert len(panels) == 12
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("regional", ["1", "0"])
def test_the_fused_draft_adapter_runs_in_its_projections_gemm(monkeypatch, regional):
    """A draft forward with the inference form of the adapter (LoRA on q, v (not k), o, gate, up,
    down): each of the layer's four projections is one skinny_lora_linear (base panels, the fused
    A, the compact B, the adapter gate), no aten mm is left, and the step gives the eager logits;
    the same with every layer traced inline."""
    gm, out, ref, _ = _compiled_graph(monkeypatch, regional, layers=2, draft=True)
    body = _region_body(gm) if regional == "1" else gm
    per = 1 if regional == "1" else 2
    ops = kernels.active().ops
    assert len(_calls(body.graph, ops.skinny_lora_linear.default)) == 4 * per
    assert len(_calls(body.graph, ops.skinny_linear.default)) == (regional == "0")     # the head
    assert not _calls(body.graph, F.linear) and not _calls(body.graph, torch._C._nn.linear)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_fastspec_attention_sdpa_keeps_the_gathered_attention(monkeypatch):
    """The A/B switch: with FASTSPEC_ATTENTION=sdpa a compiled layer has no kernel attention."""
    monkeypatch.setenv("FASTSPEC_ATTENTION", "sdpa")
    gm, out, ref, _ = _compiled_graph(monkeypatch, "1", layers=2)
    assert not _calls(_region_body(gm).graph, kernels.active().ops.cache_attention.default)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    monkeypatch.delenv("FASTSPEC_ATTENTION")
    gm, _, _, _ = _compiled_graph(monkeypatch, "1", layers=2)
    assert len(_calls(_region_body(gm).graph, kernels.active().ops.cache_attention.default)) == 1


@needs_kernel
def test_whole_step_compilation_is_still_available(monkeypatch):
    """FASTSPEC_REGIONAL=0 traces every layer inline: no regions, every big GEMM packed in place."""
    gm, out, ref, _ = _compiled_graph(monkeypatch, "0", layers=2)
    assert not _calls(gm.graph, torch.ops.higher_order.invoke_subgraph)
    assert len(_calls(gm.graph, kernels.active().ops.skinny_linear.default)) == 4 * 2 + 1
    assert len(_calls(gm.graph, kernels.active().ops.cache_attention.default)) == 2
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
