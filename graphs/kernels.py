"""CPU skinny-GEMM kernel for decode-shaped linears (few tokens x big weight), fp32, AVX-512.

Why: on this class of CPU (2 cores, AVX-512) a decode step is bound by streaming the weights once.
MKL's fp32 GEMM (what F.linear and inductor's freezing pick on x86) reaches ~15-30 GB/s on these
shapes and oneDNN ~35-45 GB/s; this kernel streams a pre-packed weight at ~50-85 GB/s and stays
near that up to ~8 tokens.

Layout: the [out, in] weight is packed once into column panels `[ceil(out/32), in, 32]` (zero
padded), so each 32-output panel is one contiguous stream. The micro-kernel keeps up to 12 token
rows x 32 outputs in 24 zmm accumulators, broadcasting x[m, i] against two weight vectors; more
tokens re-read the panel from L2. Threads: torch's own pool via at::parallel_for (so
torch.set_num_threads applies and no second OpenMP runtime spins).

Exposed as the torch op `fastspec::skinny_linear(x, packed, out_features)` with a fake impl, so
torch.compile/inductor call it as an extern kernel. `available()` is False when the CPU lacks
AVX-512 or the extension cannot be built; callers then fall back to F.linear.
"""
from __future__ import annotations

import functools
import hashlib
import os

import torch

PANEL = 32

_CPP = r"""
#include <immintrin.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIndexing.h>
#include <torch/library.h>

namespace {

template <int MR>
void ukern(const float* __restrict p, const float* __restrict x, int64_t ldx,
           float* __restrict y, int64_t ldy, int64_t I, int64_t ncols) {
  __m512 a0[MR], a1[MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; m++) { a0[m] = _mm512_setzero_ps(); a1[m] = _mm512_setzero_ps(); }
  for (int64_t i = 0; i < I; i++) {
    __m512 w0 = _mm512_loadu_ps(p + i * 32);
    __m512 w1 = _mm512_loadu_ps(p + i * 32 + 16);
#pragma GCC unroll 16
    for (int m = 0; m < MR; m++) {
      __m512 xv = _mm512_set1_ps(x[m * ldx + i]);
      a0[m] = _mm512_fmadd_ps(w0, xv, a0[m]);
      a1[m] = _mm512_fmadd_ps(w1, xv, a1[m]);
    }
  }
  if (ncols == 32) {
#pragma GCC unroll 16
    for (int m = 0; m < MR; m++) {
      _mm512_storeu_ps(y + m * ldy, a0[m]);
      _mm512_storeu_ps(y + m * ldy + 16, a1[m]);
    }
  } else {
    __mmask16 k0 = ncols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
    __mmask16 k1 = ncols <= 16 ? (__mmask16)0 : (__mmask16)((1u << (ncols - 16)) - 1);
    for (int m = 0; m < MR; m++) {
      _mm512_mask_storeu_ps(y + m * ldy, k0, a0[m]);
      _mm512_mask_storeu_ps(y + m * ldy + 16, k1, a1[m]);
    }
  }
}

using kfn = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t, int64_t);
const kfn KERNELS[13] = {nullptr, ukern<1>, ukern<2>, ukern<3>, ukern<4>, ukern<5>, ukern<6>,
                         ukern<7>, ukern<8>, ukern<9>, ukern<10>, ukern<11>, ukern<12>};

at::Tensor pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack_weight: 2-D fp32 weight");
  auto wc = w.contiguous();
  const int64_t O = wc.size(0), I = wc.size(1), nb = (O + 31) / 32;
  auto p = at::zeros({nb, I, 32}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = p.data_ptr<float>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++)
      for (int64_t j = 0; j < 32 && b * 32 + j < O; j++)
        for (int64_t i = 0; i < I; i++)
          dst[(b * I + i) * 32 + j] = src[(b * 32 + j) * I + i];
  });
  return p;
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "skinny_linear: fp32 only");
  const int64_t I = x.size(-1);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == I && packed.size(2) == 32,
              "skinny_linear: packed weight does not match input features");
  const int64_t O = out_features, nb = packed.size(0);
  TORCH_CHECK(nb * 32 >= O, "skinny_linear: bad out_features");
  auto xc = x.contiguous();
  const int64_t M = xc.numel() / I;
  auto out_shape = x.sizes().vec();
  out_shape.back() = O;
  auto y = at::empty(out_shape, xc.options());
  if (M == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int nt = at::get_num_threads();
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t b = 0; b < nb; b++) {
    {
      const float* pb = pp + b * I * 32;
      const int64_t nc = std::min<int64_t>(32, O - b * 32);
      for (int64_t m0 = 0; m0 < M; m0 += 12) {
        const int64_t mr = std::min<int64_t>(12, M - m0);
        KERNELS[mr](pb, xp + m0 * I, I, yp + m0 * O + b * 32, O, I, nc);
      }
    }
  }
  return y;
}

// cache[layer][rows, :, cols] = value, in place (rows/cols broadcast like advanced indexing).
void kv_write_(at::Tensor& cache, int64_t layer, const at::Tensor& rows, const at::Tensor& cols,
               const at::Tensor& value) {
  using at::indexing::Slice;
  cache.select(0, layer).index_put_({rows, Slice(), cols}, value.to(cache.scalar_type()));
}

}  // namespace

TORCH_LIBRARY(fastspec, m) {
  m.def("kv_write_(Tensor(a!) cache, int layer, Tensor rows, Tensor cols, Tensor value) -> ()");
  m.def("skinny_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("pack_weight(Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(fastspec, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("pack_weight", &pack_weight);
  m.impl("kv_write_", &kv_write_);
}
"""


def _build_dir() -> str:
    from fastspec.files import cache_dir
    d = str(cache_dir() / "extensions")
    os.makedirs(d, exist_ok=True)
    return d


@functools.cache
def available() -> bool:
    """Build (once; cached on disk) and load the kernel. False if unsupported or the build fails."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512",):
        return False
    try:
        from torch.utils.cpp_extension import load_inline

        name = "fastspec_skinny_" + hashlib.sha1((_CPP + torch.__version__).encode()).hexdigest()[:12]
        build = os.path.join(_build_dir(), name)
        os.makedirs(build, exist_ok=True)
        load_inline(name=name, cpp_sources=[_CPP], functions=None, build_directory=build,
                    extra_cflags=["-O3", "-mavx512f", "-mavx512dq", "-mfma", "-fopenmp", "-DNDEBUG"],
                    extra_ldflags=["-fopenmp"],
                    is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, missing headers...: the caller falls back to F.linear
        import warnings
        warnings.warn(f"fastspec: skinny_linear kernel unavailable ({type(e).__name__}: {e})")
        return False

    @torch.library.register_fake("fastspec::skinny_linear")
    def _(x, packed, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("fastspec::kv_write_")
    def _(cache, layer, rows, cols, value):
        return None

    return True


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """[out, in] fp32 -> [ceil(out/32), in, 32] panels (a copy; the original is untouched)."""
    if not available():
        raise RuntimeError("fastspec skinny_linear kernel is unavailable on this machine")
    with torch.no_grad():
        return torch.ops.fastspec.pack_weight(w.detach())


def skinny_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.fastspec.skinny_linear(x, packed, out_features)


@functools.cache
def kv_write_op():
    """In-place `cache[layer][rows, :, cols] = value` as an opaque op (C++ when built, else Python)."""
    if available():
        return torch.ops.fastspec.kv_write_.default

    @torch.library.custom_op("fastspec_py::kv_write_", mutates_args=("cache",))
    def kv_write_(cache: torch.Tensor, layer: int, rows: torch.Tensor, cols: torch.Tensor,
                  value: torch.Tensor) -> None:
        cache[layer][rows, :, cols] = value.to(cache.dtype)

    return torch.ops.fastspec_py.kv_write_.default

