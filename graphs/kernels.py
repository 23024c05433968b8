"""CPU skinny-GEMM kernel for decode-shaped linears (few tokens x big weight): one source, every ISA.

Why: a decode step on a CPU is bound by streaming the weights once. MKL's fp32 GEMM (what F.linear
and inductor pick on x86) reaches ~15-30 GB/s on these shapes; this kernel streams a pre-packed
weight near the memory bandwidth and stays there up to ~8 tokens.

One C++ source (`_CPP`) is compiled once per instruction set, with a small vector type per ISA
behind one interface (`Vec`: L fp32 lanes; zero / set1 / load / fma / mul / add / store):
    ISA      lanes  panel (outputs)  rows per micro-tile  accumulators        flags
    avx512   16     32 (2 zmm)       12                   24 of 32 zmm        -mavx512f/bw/dq/vl -mfma
    avx2      8     16 (2 ymm)        6                   12 of 16 ymm        -mavx2 -mfma
    neon      4     16 (4 q)          6                   24 of 32 q          (none: aarch64 base ISA)
The micro-kernel is one template over `Vec`: up to MR token rows x PANEL outputs stay in registers,
x[m, i] is broadcast against the panel's NV = PANEL / L weight vectors. More rows than MR go in
balanced tiles that take turns on each KC-input chunk of the panel while it sits in L1 (the panel
streams from memory once, overlapped with every tile's FMAs); from 2 rows on, later weight rows
are prefetched in software.

Weights (fastspec/weights.py decides the precision; activations, accumulation and outputs stay
fp32): the [out, in] weight is packed once into column panels `[ceil(out/PANEL), in, PANEL]`
(zero padded) so each panel is one contiguous stream, stored as
    fp32   float
    bf16   bfloat16 (uint16): widened in registers by a 16-bit shift (exact)
    int8   int8 plus one fp32 scale per output (symmetric, per output channel): widened to fp32 in
           registers, the scale applied once to each finished accumulator: y[o] = s[o] * sum q[o,i] x[i]
A draft forward's projection with its LoRA runs as one call, `skinny_lora_linear`: u = x @ A^T
over A's fp32 panels, then each output panel of W adds gate * (u @ B^T) for its rows of B, packed
as only the columns those rows use (`Kernel.pack_lora_b`; `LoraTail` in the source).
Threads: torch's own pool via at::parallel_for over panels (torch.set_num_threads applies; the
extension is built with -fopenmp, without which that header-inlined loop silently runs on one
thread, and links the libgomp torch already loaded).

Choice at run time: the widest ISA the CPU runs (torch.backends.cpu.get_cpu_capability() on x86,
NEON on aarch64); `FASTSPEC_ISA=avx512|avx2|neon|none` forces a narrower one (a wider one than the
CPU has is refused). Each ISA builds on first use into its own extension (cached on disk under
cache_dir()/extensions) with its own op namespace (`torch.ops.fastspec_avx2.skinny_linear`, ...),
so several can be loaded in one process (the tests compare them). When no kernel is used, one
warning line says why and what it costs, once per process; `kernel_path()` names what runs.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from fastspec.config import FastspecError
from fastspec.weights import PRECISIONS

_PANEL_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}

_CPP = r"""
// Harnesses that run parts without torch (tests/test_kernels.py, cross-compiled for NEON):
//   FASTSPEC_NO_TORCH                       the GEMM micro-kernels alone;
//   FASTSPEC_NO_TORCH + FASTSPEC_VEC_ONLY   also attention's core, on ATen's header-only vectors.
#if !defined(FASTSPEC_NO_TORCH) || defined(FASTSPEC_VEC_ONLY)
#define FASTSPEC_ATTENTION
#include <ATen/cpu/vec/functional.h>   // at::vec::Vectorized<float>: width from CPU_CAPABILITY_*
#include <ATen/cpu/vec/vec.h>
#endif
#ifndef FASTSPEC_NO_TORCH
// The few ATen headers the ops use, not <ATen/ATen.h> (every op's declaration): the first use
// on a machine builds this source, and headers were most of that build's time.
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#endif
#include <cmath>
#include <limits>
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#define FS_INLINE inline __attribute__((always_inline))

// Everything below has internal linkage: the per-ISA builds of this source live in one process
// (the tests load several) and must not bind each other's template instances.
namespace {

// --- one vector type per ISA, one interface -------------------------------------------------
// L fp32 lanes; zero, set1, fma, mul, add, store. load(const float*), load(const uint16_t*) (bf16: the 16 bits become the high
// half of an fp32, exactly), load(const int8_t*) (sign-extended, converted exactly).
#if defined(FASTSPEC_ISA_AVX512)
#include <immintrin.h>
constexpr int PANEL = 32, MR_MAX = 12;
struct Vec {
  static constexpr int L = 16;
  __m512 v;
  static FS_INLINE Vec zero() { return {_mm512_setzero_ps()}; }
  static FS_INLINE Vec set1(float a) { return {_mm512_set1_ps(a)}; }
  static FS_INLINE Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static FS_INLINE Vec load(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static FS_INLINE Vec load(const int8_t* p) {
    __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm512_cvtepi32_ps(w)};
  }
  static FS_INLINE Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static FS_INLINE Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static FS_INLINE Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  FS_INLINE void store(float* p) const { _mm512_storeu_ps(p, v); }
};
#elif defined(FASTSPEC_ISA_AVX2)
#include <immintrin.h>
constexpr int PANEL = 16, MR_MAX = 6;      // 16 ymm: 12 accumulators, 2 weights, 1 broadcast
struct Vec {
  static constexpr int L = 8;
  __m256 v;
  static FS_INLINE Vec zero() { return {_mm256_setzero_ps()}; }
  static FS_INLINE Vec set1(float a) { return {_mm256_set1_ps(a)}; }
  static FS_INLINE Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static FS_INLINE Vec load(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  static FS_INLINE Vec load(const int8_t* p) {
    __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_cvtepi32_ps(w)};
  }
  static FS_INLINE Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static FS_INLINE Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  static FS_INLINE Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  FS_INLINE void store(float* p) const { _mm256_storeu_ps(p, v); }
};
#elif defined(FASTSPEC_ISA_NEON)
#include <arm_neon.h>
constexpr int PANEL = 16, MR_MAX = 6;      // 32 q registers: 24 accumulators, 4 weights, 1 broadcast
struct Vec {
  static constexpr int L = 4;
  float32x4_t v;
  static FS_INLINE Vec zero() { return {vdupq_n_f32(0.f)}; }
  static FS_INLINE Vec set1(float a) { return {vdupq_n_f32(a)}; }
  static FS_INLINE Vec load(const float* p) { return {vld1q_f32(p)}; }
  static FS_INLINE Vec load(const uint16_t* p) {
    return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))};
  }
  static FS_INLINE Vec load(const int8_t* p) {
    int32_t four;
    std::memcpy(&four, p, 4);
    int16x8_t w16 = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)));
    return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(w16)))};
  }
  static FS_INLINE Vec fma(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
  static FS_INLINE Vec mul(Vec a, Vec b) { return {vmulq_f32(a.v, b.v)}; }
  static FS_INLINE Vec add(Vec a, Vec b) { return {vaddq_f32(a.v, b.v)}; }
  FS_INLINE void store(float* p) const { vst1q_f32(p, v); }
};
#else
#error "define one of FASTSPEC_ISA_AVX512, FASTSPEC_ISA_AVX2, FASTSPEC_ISA_NEON"
#endif

constexpr int NV = PANEL / Vec::L;         // weight vectors per panel row

// acc[m][:] += x[m, i] * panel[i, :] for MR rows: one weight row widened once, used MR times.
template <int MR, typename WT>
FS_INLINE void step(Vec (&acc)[MR][NV], const WT* __restrict p, const float* __restrict x,
                    int64_t ldx, int64_t i, const WT* pf) {
  if (pf != nullptr) {                     // software prefetch of a later weight row, to L2
#pragma GCC unroll 4
    for (size_t b = 0; b < PANEL * sizeof(WT); b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(pf + i * PANEL) + b, 0, 1);
  }
  Vec w[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; v++) w[v] = Vec::load(p + i * PANEL + v * Vec::L);
#pragma GCC unroll 16
  for (int m = 0; m < MR; m++) {
    Vec xb = Vec::set1(x[m * ldx + i]);
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) acc[m][v] = Vec::fma(w[v], xb, acc[m][v]);
  }
}

// c[m, :] (+)= sum_{i0 <= i < i1} x[m, i] * panel[i, :] for MR rows, in registers; c is the
// [MR, PANEL] block of a scratch of whole panel rows (add: accumulate onto it, else overwrite).
// pf: prefetch pf[i] alongside p[i] (nullptr: none).
// Few rows (decode) give few independent FMA chains, so U interleaved accumulator sets (summed
// at the end) keep ~8 chains in flight: without them a 1-row int8 panel waits on FMA latency.
template <int MR, typename WT>
void ukern(const WT* __restrict p, const float* __restrict x, int64_t ldx, int64_t i0, int64_t i1,
           float* __restrict c, bool add, const WT* pf) {
  constexpr int U = MR * NV >= 8 ? 1 : (8 / (MR * NV) >= 4 ? 4 : 8 / (MR * NV));
  Vec acc[U][MR][NV];
#pragma GCC unroll 4
  for (int u = 0; u < U; u++)
#pragma GCC unroll 16
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 8
      for (int v = 0; v < NV; v++)
        acc[u][m][v] = (u == 0 && add) ? Vec::load(c + m * PANEL + v * Vec::L) : Vec::zero();
  int64_t i = i0;
  for (; i + U <= i1; i += U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; u++) step<MR>(acc[u], p, x, ldx, i + u, pf);
  }
  for (; i < i1; i++) step<MR>(acc[0], p, x, ldx, i, pf);
#pragma GCC unroll 16
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) {
#pragma GCC unroll 4
      for (int u = 1; u < U; u++) acc[0][m][v] = Vec::add(acc[0][m][v], acc[u][m][v]);
      acc[0][m][v].store(c + m * PANEL + v * Vec::L);
    }
}

template <typename WT>
using ukern_fn = void (*)(const WT*, const float*, int64_t, int64_t, int64_t, float*, bool,
                          const WT*);

template <typename WT, size_t... R>
constexpr std::array<ukern_fn<WT>, MR_MAX + 1> table(std::index_sequence<R...>) {
  return {nullptr, &ukern<R + 1, WT>...};
}

// Panels [b0, b1) of y[M, O] = x[M, I] @ W^T, W packed as [ceil(O/PANEL), I, PANEL].
// Rows go in tiles of balanced height (16 rows at MR_MAX 12: 8 + 8, not 12 + 4: a thin tile
// re-reads the panel for few FMAs). With several tiles the panel is walked in chunks of KC
// inputs and every tile takes its turn on a chunk while it sits in L1: the panel streams from
// memory once, overlapped with all rows' FMAs (tile after tile over the whole panel would add
// each later tile's compute to the streaming time).
// Software prefetch, KC rows ahead (past the panel's end: the next panel's start, which comes
// next), by every tile (issued by the first tile alone, the burst outran the outstanding-miss
// slots and the next chunk was not in flight during the later tiles' turns: AVX2 8 rows 15%
// slower). Measured on Zen 4 it pays once the loop spends longer per weight byte
// than one fp32 row over a 128-byte AVX-512 row (2+ rows over a <= 64-byte row: bf16, int8, AVX2)
// and costs ~10% where the hardware prefetcher already keeps up (1 fp32 row; 2-4 rows over 128
// bytes). A single row over a <= 64-byte panel row needs it too on Sapphire Rapids (a whole
// decode forward's GEMMs, 2 threads: AVX-512 bf16 15.0 -> 12.1 ms, int8 9.3 -> 7.0 ms; AVX2 fp32
// 25.0 -> 22.4 ms; AVX-512 fp32, 128-byte rows, unchanged), there from 4 KB ahead (the L2
// streamer stops at each 4 KB page; 8 KB ahead was ~5% slower).
constexpr int64_t KC = 256;

template <typename WT>
constexpr bool prefetch_rows(int64_t M) {
  return PANEL * sizeof(WT) <= 64 || M >= 8;
}

// The rule above is what Sapphire Rapids and Zen 4 want; Zen 3 differs (its AVX2 fp32 decode
// GEMMs: 44 ms with the 1-row prefetch, 32 ms without). So a machine may overwrite it once, after
// measuring both (fastspec.graphs.kernels.tune_prefetch): per weight type (fp32, bf16, int8) and
// 1 row | more rows, -1 = the rule, 0 = off, 1 = on. Set before any GEMM runs, read-only after.
int g_prefetch[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}};

template <typename WT>
constexpr int weight_type() {
  return std::is_same<WT, float>::value ? 0 : std::is_same<WT, uint16_t>::value ? 1 : 2;
}

template <typename WT>
bool prefetch_on(int64_t M) {
  const int p = g_prefetch[weight_type<WT>()][M > 1];
  return p < 0 ? prefetch_rows<WT>(M) : p > 0;
}

// How many panel rows ahead to prefetch.
template <typename WT>
constexpr int64_t prefetch_distance(int64_t M) {
  return M == 1 ? 4096 / int64_t(PANEL * sizeof(WT)) : KC;
}

// A draft adapter's low-rank term, added to a projection in the same pass over its panels:
// y[m] += gate[m] * (u[m] @ B^T), u = x @ A^T computed first. B is packed per output panel as
// the range of u's columns its rows use (a fused q/k/v B is block-diagonal: a panel of q outputs
// reads q's rank columns of u only):
//     B [O, R] rows of panel b, columns [r0, r0 + nr)  ->  [nr, PANEL] at lora_b + offset
//     index[b] = (offset, r0, nr)          (nr = 0: no LoRA rows in this panel)
struct LoraTail {
  const float* u;           // [M, ldu]
  int64_t ldu;
  const void* b;            // the compact panels, one after another: fp32, or bf16 when b16
  bool b16;
  const int64_t* index;     // [panels, 3]
  const float* gate;        // [M]: the adapter flag of each row
};

template <typename WT>
void panels(const WT* packed, const float* scales, const float* x, float* y, int64_t M, int64_t I,
            int64_t O, int64_t b0, int64_t b1, const LoraTail* lora = nullptr) {
  static constexpr auto K = table<WT>(std::make_index_sequence<MR_MAX>{});
  static constexpr auto KF = table<float>(std::make_index_sequence<MR_MAX>{});
  static constexpr auto KH = table<uint16_t>(std::make_index_sequence<MR_MAX>{});
  const int64_t tiles = (M + MR_MAX - 1) / MR_MAX;
  const int64_t kc = tiles == 1 ? I : KC;
  const bool pf = prefetch_on<WT>(M);
  const int64_t pf_rows = prefetch_distance<WT>(M);
  std::vector<float> scratch((lora != nullptr ? 2 : 1) * M * PANEL);
  float* c = scratch.data();
  float* c2 = lora != nullptr ? c + M * PANEL : nullptr;
  for (int64_t b = b0; b < b1; b++) {
    const WT* pb = packed + b * I * PANEL;
    for (int64_t i0 = 0; i0 < I; i0 += kc) {
      const int64_t i1 = std::min(I, i0 + kc);
      for (int64_t t = 0, m0 = 0; t < tiles; t++) {
        const int64_t mr = M / tiles + (t < M % tiles ? 1 : 0);
        K[mr](pb, x + m0 * I, I, i0, i1, c + m0 * PANEL, i0 > 0,
              pf ? pb + pf_rows * PANEL : nullptr);
        m0 += mr;
      }
    }
    // The finished panel: int8 scales once per output, the ragged last panel cut to O.
    const int64_t nc = std::min<int64_t>(PANEL, O - b * PANEL);
    const float* sb = scales == nullptr ? nullptr : scales + b * PANEL;
    const int64_t lnr = lora == nullptr ? 0 : lora->index[3 * b + 2];
    if (lnr > 0) {
      // The LoRA term in its own sums, added after the scaled base: the same arithmetic as
      // y = x W^T + (u B^T) * gate run as separate ops (bit for bit).
      const int64_t off = lora->index[3 * b];
      const float* lu = lora->u + lora->index[3 * b + 1];
      for (int64_t t = 0, m0 = 0; t < tiles; t++) {
        const int64_t mr = M / tiles + (t < M % tiles ? 1 : 0);
        if (lora->b16)
          KH[mr](static_cast<const uint16_t*>(lora->b) + off, lu + m0 * lora->ldu, lora->ldu, 0, lnr,
                 c2 + m0 * PANEL, false, nullptr);
        else
          KF[mr](static_cast<const float*>(lora->b) + off, lu + m0 * lora->ldu, lora->ldu, 0, lnr,
                 c2 + m0 * PANEL, false, nullptr);
        m0 += mr;
      }
      for (int64_t m = 0; m < M; m++) {
        float* yr = y + m * O + b * PANEL;
        const float* cr = c + m * PANEL;
        const float* dr = c2 + m * PANEL;
        const float g = lora->gate[m];
        // Two passes, so the scaled base is rounded before the sum (one expression may be
        // contracted into fma(c, s, d * g), which rounds once: not the separate ops' result).
        if (sb != nullptr)
          for (int64_t o = 0; o < nc; o++) yr[o] = cr[o] * sb[o];
        else
          std::memcpy(yr, cr, nc * sizeof(float));
        for (int64_t o = 0; o < nc; o++) yr[o] += dr[o] * g;
      }
      continue;
    }
    for (int64_t m = 0; m < M; m++) {
      float* yr = y + m * O + b * PANEL;
      const float* cr = c + m * PANEL;
      if (sb != nullptr)
        for (int64_t o = 0; o < nc; o++) yr[o] = cr[o] * sb[o];
      else
        std::memcpy(yr, cr, nc * sizeof(float));
    }
  }
}

#ifndef FASTSPEC_NO_TORCH

// The checks both GEMM ops make on x and a packed weight; returns the int8 scales (else null).
const float* checked_weight(const char* op, const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& scales, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": fp32 activations only");
  const int64_t I = x.size(-1);
  TORCH_CHECK(I > 0, op, ": no input features");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == I && packed.size(2) == PANEL && packed.is_contiguous(),
              op, ": packed weight is not [panels, ", I, ", ", PANEL, "] for this ISA");
  const int64_t O = out_features, nb = packed.size(0);
  TORCH_CHECK(O > 0 && nb * PANEL >= O && (nb - 1) * PANEL < O, op, ": bad out_features");
  if (packed.scalar_type() != at::kChar) {
    TORCH_CHECK(!scales.has_value(), op, ": scales go with int8 panels only");
    return nullptr;
  }
  TORCH_CHECK(scales.has_value() && scales->scalar_type() == at::kFloat && scales->is_contiguous()
              && scales->numel() == nb * PANEL, op, ": int8 panels need fp32 scales [panels * PANEL]");
  return scales->data_ptr<float>();
}

// y[M, O] = x @ W^T (+ the LoRA tail) over all of W's panels, threads splitting the panels.
void run_panels(const char* op, const at::Tensor& packed, const float* sp, const float* xp, float* yp,
                int64_t M, int64_t I, int64_t O, const LoraTail* lora = nullptr) {
  auto run = [&](auto* wp) {
    at::parallel_for(0, packed.size(0), 1, [&](int64_t b0, int64_t b1) {
      panels(wp, sp, xp, yp, M, I, O, b0, b1, lora);
    });
  };
  switch (packed.scalar_type()) {
    case at::kFloat: run(packed.data_ptr<float>()); break;
    case at::kBFloat16: run(reinterpret_cast<const uint16_t*>(packed.data_ptr())); break;
    case at::kChar: run(packed.data_ptr<int8_t>()); break;
    default: TORCH_CHECK(false, op, ": panels must be float32, bfloat16 or int8");
  }
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& scales, int64_t out_features) {
  const float* sp = checked_weight("skinny_linear", x, packed, scales, out_features);
  const int64_t I = x.size(-1), O = out_features;
  auto xc = x.contiguous();
  const int64_t M = xc.numel() / I;
  auto out_shape = x.sizes().vec();
  out_shape.back() = O;
  auto y = at::empty(out_shape, xc.options());
  if (M == 0) return y;
  run_panels("skinny_linear", packed, sp, xc.data_ptr<float>(), y.data_ptr<float>(), M, I, O);
  return y;
}

// y = x @ W^T + gate * ((x @ A^T) @ B^T): a projection with the draft adapter's fused LoRA in
// one call (3 calls and 2 pointwise ops before). W as for skinny_linear; A packed as panels
// [ceil(R/PANEL), I, PANEL] and B as LoraTail describes (Kernel.pack_lora_b), both fp32 or both
// bf16; gate [M], one per row.
at::Tensor skinny_lora_linear(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& scales, int64_t out_features,
                              const at::Tensor& a_packed, const at::Tensor& b_packed,
                              const at::Tensor& b_index, const at::Tensor& gate) {
  const float* sp = checked_weight("skinny_lora_linear", x, packed, scales, out_features);
  const int64_t I = x.size(-1), O = out_features, nb = packed.size(0);
  const bool lora16 = a_packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(a_packed.dim() == 3 && a_packed.size(1) == I && a_packed.size(2) == PANEL
              && (lora16 || a_packed.scalar_type() == at::kFloat) && a_packed.is_contiguous(),
              "skinny_lora_linear: A is not fp32 or bf16 panels [panels, ", I, ", ", PANEL, "]");
  const int64_t R = a_packed.size(0) * PANEL;
  TORCH_CHECK(b_index.dim() == 2 && b_index.size(0) == nb && b_index.size(1) == 3
              && b_index.scalar_type() == at::kLong && b_index.is_contiguous(),
              "skinny_lora_linear: B index must be int64 [", nb, ", 3]");
  TORCH_CHECK(b_packed.dim() == 1 && b_packed.scalar_type() == a_packed.scalar_type() && b_packed.is_contiguous(),
              "skinny_lora_linear: B must be compact panels of A's dtype");
  const int64_t* bi = b_index.data_ptr<int64_t>();
  for (int64_t b = 0; b < nb; b++)
    TORCH_CHECK(bi[3 * b] >= 0 && bi[3 * b + 1] >= 0 && bi[3 * b + 2] >= 0 && bi[3 * b + 1] + bi[3 * b + 2] <= R
                && bi[3 * b] + bi[3 * b + 2] * PANEL <= b_packed.numel(),
                "skinny_lora_linear: B index entry ", b, " outside A's rank or B's panels");
  auto xc = x.contiguous();
  const int64_t M = xc.numel() / I;
  auto gc = gate.contiguous();
  TORCH_CHECK(gc.scalar_type() == at::kFloat && gc.numel() == M,
              "skinny_lora_linear: gate must be fp32 with one value per row (", M, ")");
  auto out_shape = x.sizes().vec();
  out_shape.back() = O;
  auto y = at::empty(out_shape, xc.options());
  if (M == 0) return y;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> u(M * R);
  at::parallel_for(0, a_packed.size(0), 1, [&](int64_t b0, int64_t b1) {
    if (lora16)
      panels(reinterpret_cast<const uint16_t*>(a_packed.data_ptr()), nullptr, xp, u.data(), M, I, R, b0, b1);
    else
      panels(a_packed.data_ptr<float>(), nullptr, xp, u.data(), M, I, R, b0, b1);
  });
  const LoraTail lora{u.data(), R, b_packed.data_ptr(), lora16, bi, gc.data_ptr<float>()};
  run_panels("skinny_lora_linear", packed, sp, xp, yp, M, I, O, &lora);
  return y;
}

#endif  // !FASTSPEC_NO_TORCH

#ifdef FASTSPEC_ATTENTION
// Attention of the new tokens over their own slot's cache, read in place (no gathered copy of
// every row's K/V, which a layer otherwise pays before SDPA):
//   out[b, n, h*D:(h+1)*D] = sum_c p[c] V[slot_b, h/G, c],  p = softmax_c(scale q[b,n,h] . K[slot_b, h/G, c])
// over the columns c < ctx with mask[b, n, c] (G = heads per K/V head). Every query is computed
// alone, each sum in a fixed order of its own columns, so a token's output does not depend on
// the batch or on how many tokens share its forward (a verify row equals AR's). A query that
// sees no column gets zeros (the engine never builds one: padded rows see their own column).
//
// The queries of one K/V head (N tokens x G heads) share its K and V rows: a task takes up to QT
// of them, and within it chunks of QK_CHUNK (scores) and PV_CHUNK (p @ V) share each K and V
// load. Tasks and chunks change which loads are shared, never a query's arithmetic:
//   queries of K/V head 0 at N = 2, G = 3:  j = 0..5 -> (n, h) = (0,0) (0,1) (0,2) (1,0) (1,1) (1,2)
//   QK_CHUNK 4:                             chunks [j0 j1 j2 j3] [j4 j5]
// Scores take four columns at a time (four independent FMA chains per query) for every chunk in
// turn, so K streams from L2 once per task; the mask, max and sum run over whole vectors of
// columns; p @ V keeps two interleaved sums per output vector (even and odd columns), in blocks
// of PV_BLOCK columns that every chunk takes in turn (V too streams once per task).
// One 8-token forward's layer call (9 heads over 3 of 64, ctx 264, 2 threads, Xeon): 79 -> 44 us
// with the head dim at compile time (accumulators in registers, not on the stack), V loads kept
// in registers, and a token's mask read once for its G heads (python -m fastspec.graphs.attn_ab).
using Vf = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vf::size();
// Accumulators in registers: scores NQ x 4 columns (+4 K vectors), p @ V PQ x 2 x 4 vectors (+8
// V vectors). AVX2 has 16 registers, AVX-512 and NEON 32.
constexpr int QK_CHUNK = kLanes == 8 ? 2 : 4;
constexpr int PV_CHUNK = kLanes == 8 ? 1 : 2;

// v, kept in a register: a vector loaded once and used by several FMAs is otherwise folded into
// each FMA as a memory operand (one load per use: p @ V then waits on the load ports).
FS_INLINE Vf in_register(Vf v) {
#if defined(__AVX512F__) && defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
  __asm__("" : "+v"(r));
  return r;
#elif defined(__AVX__) && defined(CPU_CAPABILITY_AVX2)
  __m256 r = v;
  __asm__("" : "+x"(r));
  return r;
#else
  return v;
#endif
}

FS_INLINE float reduce_sum(Vf a) {
  return at::vec::vec_reduce_all<float>([](Vf& x, Vf& y) { return x + y; }, a);
}

// bitrev(i) over log2(kLanes) bits: the lane order a transposed sum leaves its inputs in.
constexpr int bitrev_lane(int i) {
  int r = 0;
  for (int b = 1; b < kLanes; b <<= 1) r = (r << 1) | ((i & b) ? 1 : 0);
  return r;
}

// The horizontal sums of kLanes vectors at once, in place: lane i of the result (x[0]) is the sum
// of the lanes of x[bitrev_lane(i)]. Each level adds lanes kLanes/2 apart, then kLanes/4, ... exactly the tree
// of reduce_sum (vec_reduce_all), so each sum is bit for bit reduce_sum's, for about a third of
// its shuffles. kLanes = 4:
//   x0 = [a0 a1 a2 a3], x1 = [b0 ..]:  interleave -> [a0 b0 a1 b1] + [a2 b2 a3 b3] = [a0+a2, b0+b2, a1+a3, b1+b3]
//   with x2, x3 likewise, then once more: [a, c, b, d] (lane 1 <- x2 = x[bitrev(1)]).
// Where accumulator a goes among the inputs of the transposed sums so that it comes out in lane
// a % kLanes of sum a / kLanes.
constexpr int slot_of(int a) { return a / kLanes * kLanes + bitrev_lane(a % kLanes); }

template <int COUNT>
FS_INLINE void transposed_sums_level(Vf* x) {   // (a level per template instance: GCC keeps x in
#pragma GCC unroll 8                            //  registers only when every loop unrolls fully)
  for (int i = 0; i < COUNT / 2; i++) {
    const auto lohi = at::vec::interleave2<float>(x[2 * i], x[2 * i + 1]);
    x[i] = lohi.first + lohi.second;
  }
  if constexpr (COUNT / 2 > 1) transposed_sums_level<COUNT / 2>(x);
}

FS_INLINE Vf transposed_sums(Vf* x) {
  transposed_sums_level<kLanes>(x);
  return x[0];
}

// p[q][c .. c+3] = scale * q_q . K[c .. c+3] for the NQ queries `qs`, k0 = K + c * D.
// DC: the head dim when known at compile time (0: D at run time). With it the loop over D unrolls
// fully and GCC keeps the accumulators in registers (over a run-time D it keeps them on the stack,
// a load and a store around every FMA).
template <int NQ, int DC>
FS_INLINE void scores4(const float* const* qs, const float* k0, int64_t D_, float sf, float* p,
                       int64_t pstride) {
  const int64_t D = DC > 0 ? DC : D_;
  // Four columns x NQ queries of accumulators, summed kLanes at a time. Accumulator a = q * 4 + j
  // (query q, column c + j) sits at slot_of(a), so that lane a % kLanes of transposed sum
  // a / kLanes holds it: lanes 4q .. 4q+3 are query q's four scores, stored as one piece.
  // (Indexed only by loops that unroll fully: GCC then keeps them in registers.)
  constexpr int kAcc = (NQ * 4 + kLanes - 1) / kLanes * kLanes;
  const int64_t dv = D - D % kLanes;
  Vf x[kAcc];
#pragma GCC unroll 16
  for (int i = 0; i < kAcc; i++) x[i] = Vf(0.f);
#pragma GCC unroll 16
  for (int64_t d = 0; d < dv; d += kLanes) {
    const Vf k0d = in_register(Vf::loadu(k0 + d)), k1d = in_register(Vf::loadu(k0 + D + d)),
             k2d = in_register(Vf::loadu(k0 + 2 * D + d)), k3d = in_register(Vf::loadu(k0 + 3 * D + d));
#pragma GCC unroll 4
    for (int q = 0; q < NQ; q++) {
      const Vf qv = in_register(Vf::loadu(qs[q] + d));
      x[slot_of(q * 4 + 0)] = at::vec::fmadd(qv, k0d, x[slot_of(q * 4 + 0)]);
      x[slot_of(q * 4 + 1)] = at::vec::fmadd(qv, k1d, x[slot_of(q * 4 + 1)]);
      x[slot_of(q * 4 + 2)] = at::vec::fmadd(qv, k2d, x[slot_of(q * 4 + 2)]);
      x[slot_of(q * 4 + 3)] = at::vec::fmadd(qv, k3d, x[slot_of(q * 4 + 3)]);
    }
  }
  alignas(64) float r[kAcc];
  if (dv == D) {
#pragma GCC unroll 4
    for (int g = 0; g < kAcc / kLanes; g++) (transposed_sums(x + g * kLanes) * Vf(sf)).store(r + g * kLanes);
  } else {   // a head dim that is not whole vectors: its last lanes one by one, then the scale
#pragma GCC unroll 4
    for (int g = 0; g < kAcc / kLanes; g++) transposed_sums(x + g * kLanes).store(r + g * kLanes);
    for (int a = 0; a < NQ * 4; a++) {
      for (int64_t d = dv; d < D; d++) r[a] += qs[a / 4][d] * k0[(a % 4) * D + d];
      r[a] *= sf;
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < NQ; q++) std::memcpy(p + q * pstride, r + q * 4, 4 * sizeof(float));
}

// scores4<nq> for a run-time nq <= NQ (only the instances this ISA's chunks can reach).
template <int NQ, int DC>
FS_INLINE void scores4_of(int64_t nq, const float* const* qs, const float* k0, int64_t D, float sf,
                          float* p, int64_t pstride) {
  if constexpr (NQ > 1)
    if (nq < NQ) return scores4_of<NQ - 1, DC>(nq, qs, k0, D, sf, p, pstride);
  scores4<NQ, DC>(qs, k0, D, sf, p, pstride);
}

// p[q][c] = scale * q_q . K[c] for nq queries, every column c < ctx. The columns go four at a
// time (K's four rows, 1 KB at D 64, stay in L1 while every chunk of QK_CHUNK queries takes them:
// K streams from L2 once per call of this, not once per chunk); the last ctx % 4 one by one.
template <int DC>
FS_INLINE int64_t scores_by_four(int64_t nq, const float* const* qs, const float* K, int64_t ctx, int64_t D,
                                 float sf, float* p, int64_t pstride) {
  int64_t c = 0;
  for (; c + 4 <= ctx; c += 4)
    for (int64_t i = 0; i < nq; i += QK_CHUNK)
      scores4_of<QK_CHUNK, DC>(std::min<int64_t>(QK_CHUNK, nq - i), qs + i, K + c * D, D, sf,
                               p + i * pstride + c, pstride);
  return c;
}

FS_INLINE void scores(int64_t nq, const float* const* qs, const float* K, int64_t ctx, int64_t D, float sf,
                      float* p, int64_t pstride) {
  const int64_t dv = D - D % kLanes;
  // Head dims of common models at compile time (the same arithmetic either way).
  int64_t c = D == 64    ? scores_by_four<64>(nq, qs, K, ctx, D, sf, p, pstride)
              : D == 128 ? scores_by_four<128>(nq, qs, K, ctx, D, sf, p, pstride)
                         : scores_by_four<0>(nq, qs, K, ctx, D, sf, p, pstride);
  for (; c < ctx; c++) {
    const float* k0 = K + c * D;
    for (int64_t q = 0; q < nq; q++) {
      Vf a0(0.f);
      for (int64_t d = 0; d < dv; d += kLanes) a0 = at::vec::fmadd(Vf::loadu(qs[q] + d), Vf::loadu(k0 + d), a0);
      float r = reduce_sum(a0);
      for (int64_t d = dv; d < D; d++) r += qs[q][d] * k0[d];
      p[q * pstride + c] = r * sf;
    }
  }
}

// seen[c] = all bits set where mask[c], 0 elsewhere and past ctx up to whole vectors (ctx rounded up
// to kLanes): the blend mask of softmax_weights. One token's heads share it.
FS_INLINE void mask_bits(const bool* mask, int64_t ctx, uint32_t* seen) {
  const int64_t ctx_vec = (ctx + kLanes - 1) / kLanes * kLanes;
  const uint8_t* m = reinterpret_cast<const uint8_t*>(mask);   // (bytes, not bool: this vectorizes)
  for (int64_t c = 0; c < ctx; c++) seen[c] = 0u - static_cast<uint32_t>(m[c]);
  for (int64_t c = ctx; c < ctx_vec; c++) seen[c] = 0u;
}

// Scores -> weights exp(s - max), exactly 0 where the query does not see the column (seen: its
// mask_bits); returns their sum, or 0 when it sees none. `p` holds whole vectors, so the lanes
// past ctx load whatever p holds there and blend it away.
FS_INLINE float softmax_weights(float* p, const uint32_t* seen, int64_t ctx) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t ctx_vec = (ctx + kLanes - 1) / kLanes * kLanes;
  Vf m(neg_inf);
  for (int64_t c = 0; c < ctx_vec; c += kLanes) {
    const Vf x = Vf::blendv(Vf(neg_inf), Vf::loadu(p + c), Vf::loadu(seen + c));
    x.store(p + c);
    m = at::vec::maximum(m, x);
  }
  const float mx = at::vec::vec_reduce_all<float>([](Vf& x, Vf& y) { return at::vec::maximum(x, y); }, m);
  if (mx == neg_inf) return 0.f;
  Vf total(0.f);
  for (int64_t c = 0; c < ctx_vec; c += kLanes) {
    const Vf e = Vf::blendv(Vf(0.f), (Vf::loadu(p + c) - Vf(mx)).exp_u20(), Vf::loadu(seen + c));
    e.store(p + c);
    total = total + e;
  }
  return reduce_sum(total);
}

// acc_q[d0 : d0 + ND vectors] += sum_{c0 <= c < c1} p_q[c] V[c, same], for PQ queries sharing each
// V load. acc_q = acc + q * 2D holds two sums per output (even columns at acc_q[d], odd ones at
// acc_q[D + d]),
// loaded and stored around the block: the same additions in the same order as sums kept in
// registers over all columns (c0 even, so the pairs (c, c + 1) are the whole call's pairs; only
// the last block may end on an odd column, which goes to the even sum).
template <int PQ, int ND>
FS_INLINE void pv_block(const float* const* ps, float* acc, const float* V, int64_t c0, int64_t c1,
                        int64_t D, int64_t d0) {
  Vf e[PQ][ND], od[PQ][ND];
#pragma GCC unroll 4
  for (int q = 0; q < PQ; q++)
#pragma GCC unroll 4
    for (int u = 0; u < ND; u++) {
      e[q][u] = Vf::loadu(acc + q * 2 * D + d0 + u * kLanes);
      od[q][u] = Vf::loadu(acc + q * 2 * D + D + d0 + u * kLanes);
    }
  int64_t c = c0;
  for (; c + 2 <= c1; c += 2) {
    const float* v0 = V + c * D + d0;
#pragma GCC unroll 4
    for (int u = 0; u < ND; u++) {
      const Vf x0 = in_register(Vf::loadu(v0 + u * kLanes)), x1 = in_register(Vf::loadu(v0 + D + u * kLanes));
#pragma GCC unroll 4
      for (int q = 0; q < PQ; q++) {
        e[q][u] = at::vec::fmadd(Vf(ps[q][c]), x0, e[q][u]);
        od[q][u] = at::vec::fmadd(Vf(ps[q][c + 1]), x1, od[q][u]);
      }
    }
  }
  if (c < c1)
#pragma GCC unroll 4
    for (int u = 0; u < ND; u++) {
      const Vf x0 = Vf::loadu(V + c * D + d0 + u * kLanes);
#pragma GCC unroll 4
      for (int q = 0; q < PQ; q++) e[q][u] = at::vec::fmadd(Vf(ps[q][c]), x0, e[q][u]);
    }
#pragma GCC unroll 4
  for (int q = 0; q < PQ; q++)
#pragma GCC unroll 4
    for (int u = 0; u < ND; u++) {
      e[q][u].store(acc + q * 2 * D + d0 + u * kLanes);
      od[q][u].store(acc + q * 2 * D + D + d0 + u * kLanes);
    }
}

template <int PQ>
FS_INLINE void pv_blocks(const float* const* ps, float* acc, const float* V, int64_t c0, int64_t c1,
                         int64_t D) {
  const int64_t dv = D - D % kLanes;
  for (int64_t d0 = 0; d0 < dv; d0 += 4 * kLanes) {
    switch (std::min<int64_t>(4, (dv - d0) / kLanes)) {
      case 4: pv_block<PQ, 4>(ps, acc, V, c0, c1, D, d0); break;
      case 3: pv_block<PQ, 3>(ps, acc, V, c0, c1, D, d0); break;
      case 2: pv_block<PQ, 2>(ps, acc, V, c0, c1, D, d0); break;
      default: pv_block<PQ, 1>(ps, acc, V, c0, c1, D, d0); break;
    }
  }
}

// Columns of V per block of p @ V: 64 rows of D 64 are 16 KB, in L1 while every query of the task
// takes them (V streams from L2 once per task, not once per PV_CHUNK queries). Even.
constexpr int64_t PV_BLOCK = 64;
// Queries per task: scores (QT x ctx) and sums (QT x 2D) of a task stay in L1/L2.
constexpr int64_t QT = 12;

// out_q = (sum_c p_q[c] V[c]) for the n queries `ps`: the even and odd sums per block of columns
// (in acc, n x 2D scratch), then their sum, then the tail dims (D % kLanes) one by one over every
// column.
FS_INLINE void weighted_values(int64_t n, const float* const* ps, float* const* os, float* acc,
                               const float* V, int64_t ctx, int64_t D) {
  const int64_t dv = D - D % kLanes;
  std::fill(acc, acc + n * 2 * D, 0.f);
  for (int64_t c0 = 0; c0 < ctx; c0 += PV_BLOCK) {
    const int64_t c1 = std::min(ctx, c0 + PV_BLOCK);
    int64_t i = 0;
    for (; i + PV_CHUNK <= n; i += PV_CHUNK) pv_blocks<PV_CHUNK>(ps + i, acc + i * 2 * D, V, c0, c1, D);
    for (; i < n; i++) pv_blocks<1>(ps + i, acc + i * 2 * D, V, c0, c1, D);
  }
  for (int64_t i = 0; i < n; i++) {
    for (int64_t d = 0; d < dv; d += kLanes)
      (Vf::loadu(acc + i * 2 * D + d) + Vf::loadu(acc + i * 2 * D + D + d)).store(os[i] + d);
    for (int64_t d = dv; d < D; d++) {
      float acc = 0.f;
      for (int64_t c = 0; c < ctx; c++) acc += ps[i][c] * V[c * D + d];
      os[i][d] = acc;
    }
  }
}

// The whole call on raw pointers: q [B, N, H, D], out [B, N, H * D], mask [B, N, ctx], K/V of
// slot s and K/V head h at k + s * k_slot + h * L * D (rows of D), slots [B] already checked to
// lie in the cache. for_tasks(n, body) runs body(t0, t1) over [0, n) split among `threads`.
template <typename ForTasks>
void attend(const float* qp, const float* kp, const float* vp, int64_t k_slot, int64_t v_slot,
            const bool* mp, const int64_t* sp, float* op, int64_t B, int64_t N, int64_t H, int64_t KV,
            int64_t L, int64_t D, int64_t ctx, int64_t threads, ForTasks&& for_tasks) {
  const int64_t G = H / KV;
  const float sf = 1.f / std::sqrt(static_cast<float>(D));   // SDPA's default scale
  // Queries per task: up to QT of one K/V head, but keep >= 2 tasks per thread so that few
  // queries (one AR token: 3 per K/V head) still spread over the threads. 8 tokens x 3 heads of a
  // K/V head at 2 threads: 2 tasks of 12 per head, 6 in all.
  const int64_t per_head = N * G;
  const int64_t fair = (B * KV * per_head) / (2 * std::max<int64_t>(1, threads));
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>({QT, fair, per_head}));
  const int64_t chunks = (per_head + chunk - 1) / chunk;
  const int64_t ctx_vec = (ctx + kLanes - 1) / kLanes * kLanes;   // p's rows: whole vectors
  for_tasks(B * KV * chunks, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(QT * ctx_vec + QT * 2 * D);   // scores, then p @ V's sums
    float* acc = p.data() + QT * ctx_vec;
    std::vector<uint32_t> seen(ctx_vec);
    for (int64_t t = t0; t < t1; t++) {
      const int64_t b = t / (KV * chunks), kv = (t / chunks) % KV, j0 = (t % chunks) * chunk;
      const int64_t nq = std::min<int64_t>(chunk, per_head - j0), slot = sp[b];
      const float* K = kp + slot * k_slot + kv * L * D;
      const float* V = vp + slot * v_slot + kv * L * D;
      const float* qs[QT];
      float* os[QT];
      const bool* ms[QT];
      for (int64_t i = 0; i < nq; i++) {
        const int64_t n = (j0 + i) / G, h = kv * G + (j0 + i) % G;
        qs[i] = qp + ((b * N + n) * H + h) * D;
        os[i] = op + (b * N + n) * H * D + h * D;
        ms[i] = mp + (b * N + n) * ctx;
      }
      scores(nq, qs, K, ctx, D, sf, p.data(), ctx_vec);
      // Queries that see columns go on to p @ V (compacted); one that sees none gets zeros.
      const float* ps[QT];
      float* live[QT];
      float sums[QT];
      int64_t nlive = 0;
      for (int64_t i = 0; i < nq; i++) {
        float* pi = p.data() + i * ctx_vec;
        if (i == 0 || ms[i] != ms[i - 1]) mask_bits(ms[i], ctx, seen.data());   // a token's G heads: once
        const float sum = softmax_weights(pi, seen.data(), ctx);
        if (sum == 0.f) {
          std::fill(os[i], os[i] + D, 0.f);
          continue;
        }
        ps[nlive] = pi;
        live[nlive] = os[i];
        sums[nlive++] = sum;
      }
      weighted_values(nlive, ps, live, acc, V, ctx, D);
      for (int64_t i = 0; i < nlive; i++) {
        const float inv = 1.f / sums[i];
        for (int64_t d = 0; d < D; d++) live[i][d] *= inv;
      }
    }
  });
}
#endif  // FASTSPEC_ATTENTION

#ifndef FASTSPEC_NO_TORCH
at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k_layer, const at::Tensor& v_layer,
                           const at::Tensor& slots, const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat, "cache_attention: q must be fp32 [B, N, H, D]");
  TORCH_CHECK(k_layer.dim() == 4 && v_layer.sizes() == k_layer.sizes() && k_layer.scalar_type() == at::kFloat
              && v_layer.scalar_type() == at::kFloat, "cache_attention: K/V must be fp32 [slots, kv_heads, len, D]");
  const int64_t B = q.size(0), N = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t S = k_layer.size(0), KV = k_layer.size(1), L = k_layer.size(2);
  TORCH_CHECK(k_layer.size(3) == D && KV > 0 && H % KV == 0, "cache_attention: head shapes disagree");
  for (const at::Tensor* t : {&k_layer, &v_layer})
    TORCH_CHECK(t->stride(3) == 1 && t->stride(2) == D && t->stride(1) == L * D,
                "cache_attention: each slot's K/V must be row-major [kv_heads, len, D]");
  TORCH_CHECK(mask.dim() == 3 && mask.size(0) == B && mask.size(1) == N && mask.scalar_type() == at::kBool
              && mask.size(2) <= L, "cache_attention: mask must be bool [B, N, ctx <= len]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.scalar_type() == at::kLong,
              "cache_attention: slots must be int64 [B]");
  const int64_t ctx = mask.size(2);
  auto qc = q.contiguous();
  auto mc = mask.contiguous();
  auto sc = slots.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < S, "cache_attention: slot ", sp[b], " outside the cache");
  auto out = at::empty({B, N, H * D}, q.options());
  attend(qc.data_ptr<float>(), k_layer.data_ptr<float>(), v_layer.data_ptr<float>(), k_layer.stride(0),
         v_layer.stride(0), mc.data_ptr<bool>(), sp, out.data_ptr<float>(), B, N, H, KV, L, D, ctx,
         at::get_num_threads(), [](int64_t n, auto&& body) { at::parallel_for(0, n, 1, body); });
  return out;
}

// The prefetch policy (g_prefetch) for one weight type (0 fp32, 1 bf16, 2 int8) and 1 row (0) |
// more rows (1): -1 the built-in rule, 0 off, 1 on. Returns the effective setting before the call
// (0 or 1), so a caller can measure both and put back what it found.
int64_t set_prefetch(int64_t weight, int64_t multi, int64_t mode) {
  TORCH_CHECK(weight >= 0 && weight < 3 && (multi == 0 || multi == 1) && mode >= -1 && mode <= 1,
              "set_prefetch: weight 0..2, multi 0|1, mode -1|0|1");
  const int64_t M = multi ? 8 : 1;
  const bool before = weight == 0 ? prefetch_on<float>(M) : weight == 1 ? prefetch_on<uint16_t>(M)
                                                                         : prefetch_on<int8_t>(M);
  g_prefetch[weight][multi] = int(mode);
  return before;
}

// cache[layer][rows, :, cols] = value, in place (rows/cols broadcast like advanced indexing).
void kv_write_(at::Tensor& cache, int64_t layer, const at::Tensor& rows, const at::Tensor& cols,
               const at::Tensor& value) {
  // [rows, None, cols]: what `cache[layer][rows, :, cols] = value` indexes with
  c10::List<std::optional<at::Tensor>> index;
  index.reserve(3);
  index.push_back(rows);
  index.push_back(std::nullopt);
  index.push_back(cols);
  cache.select(0, layer).index_put_(index, value.to(cache.scalar_type()));
}
#endif

}  // namespace

#ifndef FASTSPEC_NO_TORCH
// The op namespace is the ISA's (fastspec_avx512, ...): two expansion levels so the macro
// FASTSPEC_NS is replaced before TORCH_LIBRARY pastes it into names.
#define FS_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define FS_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
FS_LIBRARY(FASTSPEC_NS, m) {
  m.def("kv_write_(Tensor(a!) cache, int layer, Tensor rows, Tensor cols, Tensor value) -> ()");
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? scales, int out_features) -> Tensor");
  m.def("skinny_lora_linear(Tensor x, Tensor packed, Tensor? scales, int out_features, Tensor a_packed, "
        "Tensor b_packed, Tensor b_index, Tensor gate) -> Tensor");
  m.def("cache_attention(Tensor q, Tensor k_layer, Tensor v_layer, Tensor slots, Tensor mask) -> Tensor");
  m.def("set_prefetch(int weight, int multi, int mode) -> int", &set_prefetch);   // no tensors: catch-all
}
FS_LIBRARY_IMPL(FASTSPEC_NS, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_lora_linear", &skinny_lora_linear);
  m.impl("kv_write_", &kv_write_);
  m.impl("cache_attention", &cache_attention);
}
#endif
"""


@dataclass(frozen=True)
class _Isa:
    name: str
    panel: int          # outputs per packed panel (PANEL in the source)
    rows: int           # token rows per micro-tile (MR_MAX in the source)
    cflags: tuple[str, ...]


ISAS = {
    "avx512": _Isa("avx512", 32, 12, ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma",
                                      "-DCPU_CAPABILITY_AVX512")),
    "avx2": _Isa("avx2", 16, 6, ("-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2")),
    "neon": _Isa("neon", 16, 6, ()),
}
# at::parallel_for is inlined from ATen's headers: without OpenMP it runs on one thread. Apple's
# clang has no -fopenmp (torch brings its own libomp there): one thread on macOS.
_OPENMP = () if platform.system() == "Darwin" else ("-fopenmp",)


def cpu_isas() -> tuple[str, ...]:
    """The kernel ISAs this CPU runs, widest first (x86: from torch's CPU capability, so
    ATEN_CPU_CAPABILITY narrows it too; aarch64: NEON, part of the base ISA)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return ("neon",)
    if machine in ("x86_64", "amd64"):
        cap = torch.backends.cpu.get_cpu_capability()
        return {"AVX512": ("avx512", "avx2"), "AVX2": ("avx2",)}.get(cap, ())
    return ()


def _cpu_words() -> str:
    return f"{platform.machine()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


def requested_isa() -> tuple[str | None, str]:
    """(the ISA to use, or None and why): FASTSPEC_ISA if set (a wider ISA than the CPU runs is a
    FastspecError), else the widest the CPU runs."""
    have = cpu_isas()
    forced = os.environ.get("FASTSPEC_ISA", "").strip().lower()
    if forced:
        if forced == "none":
            return None, "FASTSPEC_ISA=none"
        if forced not in ISAS:
            raise FastspecError(f"FASTSPEC_ISA={forced}: unknown (choose {'|'.join(ISAS)}|none)")
        if forced not in have:
            raise FastspecError(f"FASTSPEC_ISA={forced}: this CPU ({_cpu_words()}) runs "
                                f"{', '.join(have) or 'none of ' + ', '.join(ISAS)}; unset FASTSPEC_ISA "
                                f"or pick {'|'.join((*have, 'none'))}")
        return forced, ""
    if not have:
        return None, f"{_cpu_words()}: no AVX-512, AVX2+FMA or NEON"
    return have[0], ""


def _build_dir() -> str:
    from fastspec.files import cache_dir
    d = str(cache_dir() / "extensions")
    os.makedirs(d, exist_ok=True)
    return d


@dataclass(frozen=True)
class Kernel:
    """One built ISA: its op namespace and panel geometry."""
    isa: str
    panel: int
    rows: int

    @property
    def path(self) -> str:
        return f"skinny-{self.isa}"

    @property
    def ops(self):
        return getattr(torch.ops, f"fastspec_{self.isa}")

    def pack(self, w: torch.Tensor, precision: str = "fp32",
             scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[out, in] fp32 weight -> (panels [ceil(out/panel), in, panel], scales or None).

        precision fp32 / bf16 (rounded to nearest even: exact when the weight already holds bf16
        values) / int8 (q = round(w / scales[o]) in [-127, 127]: exact when w = scales[o] * q;
        the fp32 scales come back padded to whole panels)."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown weight precision {precision!r} (choose {', '.join(PRECISIONS)})")
        with torch.no_grad():
            w = w.detach().float()
            out_features, in_features = w.shape
            panels = -(-out_features // self.panel)
            pad = panels * self.panel - out_features
            packed_scales = None
            if precision == "int8":
                if scales is None or scales.shape != (out_features,):
                    raise ValueError(f"int8 packing needs scales of shape ({out_features},)")
                s = scales.float()
                w = torch.round(w / torch.where(s > 0, s, 1.0)[:, None]).clamp_(-127, 127)
                packed_scales = torch.cat([s, s.new_zeros(pad)]).contiguous()
            w = torch.cat([w, w.new_zeros(pad, in_features)])
            # [panels * P, in] -> [panels, P, in] -> [panels, in, P]: each panel one stream.
            packed = w.view(panels, self.panel, in_features).transpose(1, 2)
            return packed.to(_PANEL_DTYPE[precision]).contiguous(), packed_scales

    def unpack(self, panels: torch.Tensor, scales: torch.Tensor | None, out_features: int) -> torch.Tensor:
        """The [out, in] fp32 weight that packed `panels` (+ int8 `scales`) compute with."""
        w = panels.float()
        if scales is not None:
            w = w * scales.view(-1, 1, self.panel)          # s[o] of each panel column
        # [panels, in, P] -> [panels * P, in] -> the first `out` rows.
        return w.transpose(1, 2).reshape(-1, w.shape[1])[:out_features]

    def linear(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        return self.ops.skinny_linear(x, packed, scales, out_features)

    def pack_lora_b(self, b: torch.Tensor, precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
        """A LoRA's [out, rank] B -> (compact panels, fp32 or bf16, index [panels, 3]) for
        skinny_lora_linear: each output panel keeps only the columns of B its rows use,
        `[nr, panel]` at `offset`, and index[b] = (offset, r0, nr). A fused q/k/v B, panel 32:

            rows of q  [Bq 0  0 ]    panels 0..17   columns  0..31   (r0 0,  nr 32)
            rows of k  [0  Bk 0 ] -> panels 18..23  columns 32..63   (r0 32, nr 32)
            rows of v  [0  0  Bv]    panels 24..29  columns 64..95   (r0 64, nr 32)

        r0 is rounded down to a multiple of 4, so each column lands in the same one of the
        micro-kernel's interleaved sums as in a plain skinny_linear over the whole B (bit-equal)."""
        with torch.no_grad():
            b = b.detach().float()
            out_features, rank = b.shape
            panels = -(-out_features // self.panel)
            b = torch.cat([b, b.new_zeros(panels * self.panel - out_features, rank)])
            blocks, index, offset = [], [], 0
            for p, rows in enumerate(b.view(panels, self.panel, rank)):
                used = (rows != 0).any(0).nonzero().flatten()
                if used.numel() == 0:
                    index.append((offset, 0, 0))
                    continue
                r0 = int(used[0]) // 4 * 4
                r1 = int(used[-1]) + 1
                blocks.append(rows[:, r0:r1].t().contiguous().flatten())     # [nr, panel]
                index.append((offset, r0, r1 - r0))
                offset += (r1 - r0) * self.panel
            compact = torch.cat(blocks) if blocks else b.new_zeros(0)
            if precision not in ("fp32", "bf16"):
                raise ValueError(f"a LoRA's B packs as fp32 or bf16, not {precision!r}")
            return compact.to(_PANEL_DTYPE[precision]).contiguous(), torch.tensor(index, dtype=torch.long)

    def lora_linear(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor | None,
                    out_features: int, a_packed: torch.Tensor, b_packed: torch.Tensor,
                    b_index: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x @ W^T + gate * ((x @ A^T) @ B^T) in one call (W from `pack`, A from `pack(A)`, B from
        `pack_lora_b`, gate one value per row of x)."""
        return self.ops.skinny_lora_linear(x, packed, scales, out_features, a_packed, b_packed,
                                           b_index, gate)


def _attention_fake(q, k_layer, v_layer, slots, mask):
    """Shape of cache_attention's output (the kernel's op and the reference): [B, N, H * D]."""
    B, N, H, D = q.shape
    return q.new_empty((B, N, H * D))


def _cflags(isa: str, ns: str) -> list[str]:
    return ["-O3", "-DNDEBUG", f"-DFASTSPEC_ISA_{isa.upper()}", f"-DFASTSPEC_NS={ns}",
            *ISAS[isa].cflags, *_OPENMP]


def _build_digest(source: str, cflags: list[str]) -> str:
    """What identifies a built extension: its source, flags and torch."""
    return hashlib.sha1((source + " ".join(cflags) + torch.__version__).encode()).hexdigest()[:12]


def build(source: str, isa: str, ns: str, prefix: str = "fastspec_skinny") -> None:
    """Compile (once; cached on disk by a digest of source, flags and torch) and load a kernel
    source for `isa` whose ops register under torch.ops.<ns>. `load` builds `_CPP`; an A/B tool
    builds another revision's source under its own namespace beside it (graphs/attn_ab.py)."""
    from torch.utils.cpp_extension import load as load_extension

    cflags = _cflags(isa, ns)
    name = f"{prefix}_{isa}_{_build_digest(source, cflags)}"
    directory = os.path.join(_build_dir(), name)
    os.makedirs(directory, exist_ok=True)
    # The source as it is: load_inline would put <torch/extension.h> (all of torch's C++ API
    # and pybind11) in front of it, for Python bindings these ops (TORCH_LIBRARY) do not use.
    path = os.path.join(directory, "kernel.cpp")
    if not os.path.exists(path) or Path(path).read_text() != source:
        tmp = f"{path}.{os.getpid()}"            # whole or not at all: another process may build too
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    with _builder_lock(directory):
        load_extension(name=name, sources=[path], build_directory=directory, extra_cflags=cflags,
                       extra_ldflags=list(_OPENMP), is_python_module=False, verbose=False)


@contextlib.contextmanager
def _builder_lock(directory: str):
    """One builder of a kernel directory at a time, and none hung by a dead one. torch's build
    waits for as long as a `lock` file sits in the directory (its FileBaton); a build killed
    midway (Ctrl-C, the OOM killer) leaves that file behind, and every later run then hung
    silently before its first token. An flock dies with its process: whoever holds it is the
    only live builder, so a baton file found under it is a dead one's."""
    try:
        import fcntl
    except ImportError:              # not POSIX: torch's baton alone
        yield
        return
    with open(os.path.join(directory, "build.flock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            baton = os.path.join(directory, "lock")
            if os.path.exists(baton):
                os.remove(baton)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def load(isa: str) -> Kernel:
    """Build (once; cached on disk) and load the kernel for `isa`; raises if the build fails.
    The caller makes sure the CPU runs `isa` (loading is fine anywhere, running is not)."""
    spec = ISAS[isa]
    ns = f"fastspec_{isa}"
    build(_CPP, isa, ns)

    @torch.library.register_fake(f"{ns}::skinny_linear")
    def _(x, packed, scales, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake(f"{ns}::skinny_lora_linear")
    def _(x, packed, scales, out_features, a_packed, b_packed, b_index, gate):
        return x.new_empty((*x.shape[:-1], out_features))

    torch.library.register_fake(f"{ns}::cache_attention")(_attention_fake)

    @torch.library.register_fake(f"{ns}::kv_write_")
    def _(cache, layer, rows, cols, value):
        return None

    return Kernel(isa, spec.panel, spec.rows)


def _warn_fallback(reason: str) -> None:
    # One line on stderr (warnings.warn would add a source line), printed by `active` (cached).
    print(f"fastspec: no skinny-GEMM kernel ({reason}); compiled CPU steps fall back to inductor's "
          f"GEMM, ~2x slower per decode forward", file=sys.stderr, flush=True)


@functools.cache
def active() -> Kernel | None:
    """The kernel compiled CPU steps use (built on first call), or None after one warning line.
    FASTSPEC_ISA wider than the CPU raises FastspecError. Cached per process
    (`active.cache_clear()` re-reads FASTSPEC_ISA)."""
    isa, reason = requested_isa()
    if isa is not None:
        try:
            return load(isa)
        except Exception as e:  # no compiler, missing headers...: callers fall back to inductor
            first = (str(e).strip().splitlines() or [""])[0][:200]
            reason = f"{isa} build failed: {type(e).__name__}: {first}"
    _warn_fallback(reason)
    return None


def available() -> bool:
    return active() is not None


def kernel_path() -> str:
    """What compiled CPU steps run their big linears with: skinny-avx512 / skinny-avx2 /
    skinny-neon, or fallback (inductor's GEMM)."""
    k = active()
    return k.path if k is not None else "fallback"



# --- software prefetch: the built-in rule, or what this machine measured ---------------------
# The kernel's prefetch rule (`prefetch_rows` in the source) was measured on Sapphire Rapids and
# Zen 4; other cores disagree (Zen 3, AVX2 fp32, 1 row: the whole forward's GEMMs 44 ms with it,
# 32 ms without). So on first use of a (kernel, weight precision) the kernel times its own GEMMs
# on ~128 MB of panels (more than a last-level cache holds) with the prefetch off and on, for 1
# row (AR) and 8 rows (a draft or verify block), and keeps the rule's choice unless the other is
# faster by more than PREFETCH_MARGIN. The choice is cached on disk per CPU model, ISA, threads,
# kernel source and model shapes. FASTSPEC_PREFETCH=auto (default) | rule | on | off.
# A timing taken while other processes share the cores says nothing about this machine (a Xeon
# measured beside a test run: fp32 8 rows "off" by 7%; alone, "on" is 1.5x faster), so when more
# than BUSY_SHARE of the machine's CPU time went elsewhere during it, the rule stays, uncached.
PREFETCH_MODES = ("auto", "rule", "on", "off")
PREFETCH_MARGIN = 0.03
BUSY_SHARE = 0.25
_WEIGHT_TYPE = {"fp32": 0, "bf16": 1, "int8": 2}
_TUNE_ROWS = (1, 8)
_TUNE_BYTES = 128 << 20
_prefetch: dict[tuple[str, str], dict] = {}


def prefetch_mode() -> str:
    mode = os.environ.get("FASTSPEC_PREFETCH", "auto").strip().lower() or "auto"
    if mode not in PREFETCH_MODES:
        raise FastspecError(f"FASTSPEC_PREFETCH={mode}: unknown (choose {'|'.join(PREFETCH_MODES)})")
    return mode


def keep_or_switch(rule_on: bool, t_off: float, t_on: float, margin: float = PREFETCH_MARGIN) -> bool:
    """Prefetch on? The rule's choice unless the other setting's time is more than `margin`
    (a fraction) below it: timing noise alone must not flip a setting."""
    t_rule, t_other = (t_on, t_off) if rule_on else (t_off, t_on)
    return (not rule_on) if t_other < t_rule * (1 - margin) else rule_on


def machine_busy_seconds() -> tuple[float, int] | None:
    """(CPU seconds every process on the machine has used, steal included: a VM's neighbours
    count too; the number of CPUs those seconds cover), from /proc/stat, whose CPUs may be more
    than a container's os.cpu_count(); None where there is none (macOS, Windows)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in lines[0].split()[1:9])
        cpus = sum(1 for line in lines[1:] if line.startswith("cpu"))
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), max(1, cpus)
    except (OSError, ValueError, IndexError):
        return None


def others_share(before: tuple[float, int] | None, after: tuple[float, int] | None,
                 own_cpu_s: float, wall_s: float) -> float:
    """Share of the machine's CPU time that went to other processes between two
    machine_busy_seconds() readings `wall_s` seconds apart (0 when the machine cannot say)."""
    if before is None or after is None or wall_s <= 0:
        return 0.0
    return max(0.0, after[0] - before[0] - own_cpu_s) / (wall_s * after[1])


def prefetch_rule(kernel: "Kernel", precision: str) -> dict[str, bool]:
    """The kernel source's own prefetch choice per row count, {"1": on?, "8": on?}, with the
    kernel left on it (set_prefetch(-1) returns the setting it replaces, so reset, then read)."""
    wt = _WEIGHT_TYPE[precision]
    for multi in range(len(_TUNE_ROWS)):
        kernel.ops.set_prefetch(wt, multi, -1)
    return {str(rows): bool(kernel.ops.set_prefetch(wt, multi, -1)) for multi, rows in enumerate(_TUNE_ROWS)}


def _cpu_key(kernel: "Kernel") -> str:
    from fastspec.graphs.profile import device_name
    # The loaded extension's own digest (load() builds _CPP under fastspec_<isa>).
    return f"{device_name('cpu')} {kernel.isa} {_build_digest(_CPP, _cflags(kernel.isa, f'fastspec_{kernel.isa}'))}"


# A decoder layer's projections when the caller names no model (SmolLM2-135M's: qkv, o, gate_up,
# down): one shape alone misleads (Zen 3, 1 row: 1536 x 576 panels gained 3% without the
# prefetch, the whole forward 25%).
_DEFAULT_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _time_gemms(kernel: "Kernel", precision: str, shapes=_DEFAULT_SHAPES,
                reps: int = 5) -> dict[tuple[int, bool], float]:
    """Median seconds of one pass over ~_TUNE_BYTES of random panels of the given [out, in]
    shapes (in order, cycled), per (rows, prefetch on), the two settings alternated pass by pass."""
    import statistics
    import time
    wt = _WEIGHT_TYPE[precision]
    dtype = _PANEL_DTYPE[precision]
    size = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(0)
    mats, total, n = [], 0, 0
    while total < _TUNE_BYTES:
        out_f, in_f = shapes[n % len(shapes)]
        n += 1
        nb = -(-out_f // kernel.panel)
        w = torch.randint(-100, 100, (nb, in_f, kernel.panel), generator=g, dtype=torch.int8)
        panels = w if precision == "int8" else (w.to(torch.float32) / 64).to(dtype)
        mats.append((panels, torch.full((nb * kernel.panel,), 0.01) if precision == "int8" else None, out_f, in_f))
        total += panels.numel() * size
    xs = {}
    out: dict[tuple[int, bool], float] = {}
    try:
        for rows in _TUNE_ROWS:
            for _, _, _, in_f in mats:
                xs[in_f] = torch.randn(rows, in_f, generator=g)
            samples: dict[bool, list[float]] = {False: [], True: []}
            for rep in range(reps + 1):
                for on in (False, True):
                    kernel.ops.set_prefetch(wt, int(rows > 1), int(on))
                    t0 = time.perf_counter()
                    for panels, scales, out_f, in_f in mats:
                        kernel.ops.skinny_linear(xs[in_f], panels, scales, out_f)
                    if rep:                          # the first pass of each setting warms up
                        samples[on].append(time.perf_counter() - t0)
            for on in (False, True):
                out[(rows, on)] = statistics.median(samples[on])
    finally:
        for multi in (0, 1):
            kernel.ops.set_prefetch(wt, multi, -1)
    return out


def tune_prefetch(kernel: "Kernel", precision: str, shapes=None) -> dict:
    """Set (once per process) and return the kernel's prefetch policy for `precision`, measured
    on the model's linear shapes ([out, in] pairs; None: a SmolLM2 layer's):
    {"1": on?, "8": on?, "source": "rule" | "measured" | "cached" | "forced" | "rule: N% of the CPU
    time went to other processes ..." (a busy machine: the timing is not kept), "ms": {...}}."""
    key = (kernel.isa, precision)
    if key in _prefetch:
        return _prefetch[key]
    mode = prefetch_mode()
    wt = _WEIGHT_TYPE[precision]
    rule = prefetch_rule(kernel, precision)
    if mode == "rule":
        policy = {**rule, "source": "rule"}
    elif mode in ("on", "off"):
        policy = {str(r): mode == "on" for r in _TUNE_ROWS} | {"source": "forced"}
    else:
        import json
        from fastspec.files import write_json
        path = os.path.join(_build_dir(), "prefetch.json")
        shapes = tuple(map(tuple, shapes or _DEFAULT_SHAPES))
        entry = f"{_cpu_key(kernel)} {precision} {hashlib.sha1(repr(shapes).encode()).hexdigest()[:8]}"
        try:
            with open(path) as f:
                known = json.load(f)
        except (OSError, ValueError):
            known = {}
        if isinstance(known.get(entry), dict) and all(str(r) in known[entry] for r in _TUNE_ROWS):
            policy = {**known[entry], "source": "cached"}
        else:
            import time
            busy0, cpu0, wall0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
            t = _time_gemms(kernel, precision, shapes)
            share = others_share(busy0, machine_busy_seconds(), time.process_time() - cpu0,
                                 time.perf_counter() - wall0)
            ms = {f"{r} row{'s' * (r > 1)}, prefetch {'on' if on else 'off'}": round(v * 1e3, 3)
                  for (r, on), v in t.items()}
            if share > BUSY_SHARE:
                policy = {**rule, "ms": ms, "source": f"rule: {share:.0%} of the CPU time went to "
                          "other processes while timing, measured again next run"}
            else:
                policy = {str(r): keep_or_switch(rule[str(r)], t[(r, False)], t[(r, True)]) for r in _TUNE_ROWS}
                policy["ms"] = ms
                known[entry] = policy
                try:
                    write_json(path, known)
                except OSError:
                    pass                                 # a read-only cache: measure again next time
                policy = {**policy, "source": "measured"}
    for multi, rows in enumerate(_TUNE_ROWS):
        kernel.ops.set_prefetch(wt, multi, int(policy[str(rows)]))
    _prefetch[key] = policy
    return policy


def model_gemms(model) -> tuple[str, tuple[tuple[int, int], ...] | None]:
    """(weight precision, [out, in] shapes of the big linears) of a model, for tune_prefetch
    (None: no model, the default shapes)."""
    from fastspec.weights import big_linear_weights, weight_precision
    if model is None:
        return "fp32", None
    # In the forward's order: the measured prefix (~_TUNE_BYTES) is its first layers. A model
    # that a cache holds (tests' tiny ones) says nothing about streaming: the default shapes.
    weights = [p for _, p in big_linear_weights(model) if p.dim() == 2]
    if sum(p.numel() for p in weights) < _TUNE_BYTES // 16:
        return weight_precision(model), None
    return weight_precision(model), tuple(tuple(p.shape) for p in weights)


def prefetch_summary(precision: str) -> str | None:
    """One phrase for run headers, e.g. "prefetch 1 row off, 8 rows on (measured)"; None before
    the kernel has run at this precision."""
    k = active()
    policy = _prefetch.get((k.isa, precision)) if k is not None else None
    if policy is None:
        return None
    onoff = lambda r: "on" if policy[str(r)] else "off"
    return f"prefetch 1 row {onoff(1)}, 8 rows {onoff(8)} ({policy['source']})"


def skinny_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """y = x @ W^T through the active kernel; `packed, scales` from `active().pack(W, ...)`."""
    k = active()
    if k is None:
        raise RuntimeError("fastspec skinny_linear kernel is unavailable on this machine")
    return k.linear(x, packed, scales, out_features)


@functools.cache
def attention_op():
    """`fastspec_py::cache_attention(q, k_layer, v_layer, slots, mask)`: the model's attention over
    its slots' cache as one opaque op whose implementation is the eager math
    (fastspec/model/llama.py `attend_cache`). Compiled CPU steps trace it; fastspec's backend
    (graphs/compile.py) swaps it for the kernel's `cache_attention`, any other backend runs it."""
    from fastspec.model.llama import attend_cache

    @torch.library.custom_op("fastspec_py::cache_attention", mutates_args=())
    def cache_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                        slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return attend_cache(q, k_layer, v_layer, slots, mask)

    cache_attention.register_fake(_attention_fake)
    return torch.ops.fastspec_py.cache_attention.default


@functools.cache
def kv_write_op():
    """In-place `cache[layer][rows, :, cols] = value` as an opaque op (C++ when built, else Python)."""
    k = active()
    if k is not None:
        return k.ops.kv_write_.default

    @torch.library.custom_op("fastspec_py::kv_write_", mutates_args=("cache",))
    def kv_write_(cache: torch.Tensor, layer: int, rows: torch.Tensor, cols: torch.Tensor,
                  value: torch.Tensor) -> None:
        cache[layer][rows, :, cols] = value.to(cache.dtype)

    return torch.ops.fastspec_py.kv_write_.default
