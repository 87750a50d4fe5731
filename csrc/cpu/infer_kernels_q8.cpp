// The int8 inner kernels of the inference experts op and of linear_infer, AVX-512 (infer_kernels.h says what each
// computes; the portable ones, the reference, are in infer_kernels.cpp). Compiled for that target function by
// function and called only where the CPU reports the instructions (`infer_kernels`).
//
// The helpers live in an anonymous namespace; the three entry points (infer_kernels_q8.h) are defined once, here.

#include "infer_kernels_q8.h"
#include "infer_tile.h"

#ifdef HF_MOE_HAS_AVX512_KERNELS

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace hf_moe {
namespace infer {
namespace {

// Software prefetch distance along each int8 weight row, in bytes. A decode streams rows of a few cache lines each,
// one after the other, and the int8 kernel computes so much per line (dequantizing) that the out-of-order window
// keeps too few reads in flight: with this distance int8 reads its weights much faster than with none (the fp32 and
// bf16 kernels, with a few instructions per line, are slower with it). Measured with benchmarks/experts_kernels.py;
// the numbers: docs/serving-cpu.md.
constexpr int64_t kPrefetchBytes = 2048;

template <typename T>
HF_AVX512 inline void prefetch_row(const T* row, int64_t c) {
  _mm_prefetch(reinterpret_cast<const char*>(row + c) + kPrefetchBytes, _MM_HINT_T0);
}

// 16 int8 weights at q as fp32, times their group's scale `sv` (broadcast). Groups span multiples of 32 inputs, so
// loops run group by group (the scale loaded once per group, no division per load).
HF_AVX512 inline __m512 dequant16(const int8_t* q, __mmask16 mask, __m512 sv) {
  const __m128i bytes = _mm_maskz_loadu_epi8(mask, q);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), sv);
}

// Quarter P of a cache line of int8 weights (16 of its 64) of each of NR rows, dequantized and multiplied into the
// MR x NR accumulators. kScaled: times the group's scale here; else (one scale per row) the scale multiplies the
// finished sums instead, one multiply per output rather than per weight: sum(x q) s, where dequantize-then-matmul
// computes sum(x (q s)); the two differ by fp32 rounding.
template <int P, int MR, int NR, bool kScaled>
HF_AVX512 inline void q8_part(const __m512i (&lines)[NR], const __m512 (&sv)[NR], const float* x, int64_t ldx,
                              int64_t c, __m512 (&acc)[MR][NR]) {
  __m512 wv[NR];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) {
    __m128i bytes;
    if constexpr (P == 0) bytes = _mm512_castsi512_si128(lines[j]);
    else bytes = _mm512_extracti32x4_epi32(lines[j], P);
    wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    if constexpr (kScaled) wv[j] = _mm512_mul_ps(wv[j], sv[j]);
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
    const __m512 xv = _mm512_loadu_ps(x + m * ldx + c + 16 * P);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
  }
}

// One fp32 activation row against NR int8 rows, the rows one after the other (in memory order, as dot_rows1 of
// infer_kernels.cpp), into acc[0][j] (unscaled when kScaled is false), each sum in the same order as the tile below.
// Faster for the same reason as there (docs/serving-cpu.md).
template <int NR, bool kScaled>
HF_AVX512 void dot_rows1_q8(const float* x, const int8_t* q, int64_t ldq, const float* scale, int64_t ld_scale,
                            int64_t group, int64_t k, __m512 (&acc)[1][NR]) {
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) {
    const int8_t* row = q + j * ldq;
    __m512 a = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < k; g0 += group) {
      const int64_t end = std::min(k, g0 + group);
      const __m512 sv = _mm512_set1_ps(kScaled ? scale[j * ld_scale + g0 / group] : 1.0f);
      int64_t c = g0;
      for (; c + 64 <= end; c += 64) {
        const __m512i line = _mm512_loadu_si512(row + c);
        prefetch_row(row, c);
#pragma GCC unroll 4
        for (int part = 0; part < 4; ++part) {
          const __m128i bytes = _mm512_extracti32x4_epi32(line, part);
          __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
          if constexpr (kScaled) w = _mm512_mul_ps(w, sv);
          a = _mm512_fmadd_ps(_mm512_loadu_ps(x + c + 16 * part), w, a);
        }
      }
      for (; c < end; c += 16) {
        const __mmask16 mask = lanes16(end - c);
        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + c), dequant16(row + c, mask, sv), a);
      }
    }
    acc[0][j] = a;
  }
}

// One register tile of int8 weights: MR fp32 activation rows against NR int8 rows, each 16 weights dequantized in
// registers (q * scale, fp32; with one scale per row (kScaled false), q, the scale applied to the sums) and used by
// all MR rows. One row (a decode step): dot_rows1_q8.
template <int MR, int NR, bool kScaled>
HF_AVX512 void dot_tile_q8(const float* x, int64_t ldx, const int8_t* q, int64_t ldq, const float* scale,
                           int64_t ld_scale, int64_t group, int64_t k, float* out, int64_t ldo) {
  __m512 acc[MR][NR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  if constexpr (MR == 1) dot_rows1_q8<NR, kScaled>(x, q, ldq, scale, ld_scale, group, k, acc);
  else for (int64_t g0 = 0; g0 < k; g0 += group) {
    const int64_t end = std::min(k, g0 + group);
    __m512 sv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) sv[j] = _mm512_set1_ps(kScaled ? scale[j * ld_scale + g0 / group] : 1.0f);
    int64_t c = g0;
    // A cache line (64 weights) of every row per step: streaming several rows 16 bytes at a time starves the
    // hardware prefetchers (much slower from memory than cache-line steps: docs/serving-cpu.md).
    for (; c + 64 <= end; c += 64) {
      __m512i lines[NR];
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        lines[j] = _mm512_loadu_si512(q + j * ldq + c);
        prefetch_row(q + j * ldq, c);
      }
      q8_part<0, MR, NR, kScaled>(lines, sv, x, ldx, c, acc);
      q8_part<1, MR, NR, kScaled>(lines, sv, x, ldx, c, acc);
      q8_part<2, MR, NR, kScaled>(lines, sv, x, ldx, c, acc);
      q8_part<3, MR, NR, kScaled>(lines, sv, x, ldx, c, acc);
    }
    for (; c < end; c += 16) {
      const __mmask16 mask = lanes16(end - c);
      __m512 wv[NR];
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) wv[j] = dequant16(q + j * ldq + c, mask, sv[j]);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * ldx + c);
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
      }
    }
  }
  if constexpr (!kScaled) {
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m512 s = _mm512_set1_ps(scale[j * ld_scale]);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm512_mul_ps(acc[m][j], s);
    }
  }
  store_tile<MR, NR>(acc, out, ldo);
}

// 16 dequantized weights (fp32) stored as they are, or rounded to bf16 (nearest even, as torch's .to(torch.bfloat16)).
HF_AVX512 inline void store16(float* d, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(d, mask, v); }
HF_AVX512 inline void store16(uint16_t* d, __mmask16 mask, __m512 v) {
  _mm256_mask_storeu_epi16(d, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// dequant_f32 / dequant_bf16 of infer_kernels.h: `cols` int8 rows, group by group (the scale loaded once per group),
// to fp32 or bf16 (T = uint16_t, the bits) rows of k values. bf16 converts two vectors into one where it can.
template <typename T>
HF_AVX512 void dequant_rows(const int8_t* q, int64_t ldq, const float* scale, int64_t ld_scale, int64_t group, int cols,
                            int64_t k, T* dst) {
  for (int j = 0; j < cols; ++j) {
    const int8_t* qr = q + j * ldq;
    const float* sr = scale + j * ld_scale;
    T* d = dst + j * k;
    for (int64_t g0 = 0; g0 < k; g0 += group) {
      const int64_t end = std::min(k, g0 + group);
      const __m512 sv = _mm512_set1_ps(sr[g0 / group]);
      int64_t c = g0;
      if constexpr (std::is_same_v<T, uint16_t>) {
        for (; c + 32 <= end; c += 32) {
          const __m512 lo = dequant16(qr + c, 0xffff, sv);
          const __m512 hi = dequant16(qr + c + 16, 0xffff, sv);
          _mm512_storeu_si512(d + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
      }
      for (; c < end; c += 16) {
        const __mmask16 mask = lanes16(end - c);
        store16(d + c, mask, dequant16(qr + c, mask, sv));
      }
    }
  }
}

}  // namespace

HF_AVX512 void dot_q8_avx512(const float* x, int64_t ldx, int64_t rows, const int8_t* q, int64_t ldq,
                             const float* scale, int64_t ld_scale, int64_t group, int cols, int64_t k, float* out,
                             int64_t ldo) {
  for (int64_t m0 = 0; m0 < rows; m0 += kTile) {
    const int mr = static_cast<int>(std::min<int64_t>(kTile, rows - m0));
    const float* xm = x + m0 * ldx;
    float* om = out + m0 * ldo;
#define HF_MOE_Q8(MR, NR)                                                          \
  if (group >= k) dot_tile_q8<MR, NR, false>(xm, ldx, q, ldq, scale, ld_scale, group, k, om, ldo); \
  else dot_tile_q8<MR, NR, true>(xm, ldx, q, ldq, scale, ld_scale, group, k, om, ldo)
#define HF_MOE_Q8_COLS(MR)                       \
  switch (cols) {                                \
    case 1: HF_MOE_Q8(MR, 1); break;             \
    case 2: HF_MOE_Q8(MR, 2); break;             \
    case 3: HF_MOE_Q8(MR, 3); break;             \
    default: HF_MOE_Q8(MR, 4); break;            \
  }
    switch (mr) {
      case 1: HF_MOE_Q8_COLS(1) break;
      case 2: HF_MOE_Q8_COLS(2) break;
      case 3: HF_MOE_Q8_COLS(3) break;
      default: HF_MOE_Q8_COLS(4) break;
    }
#undef HF_MOE_Q8_COLS
#undef HF_MOE_Q8
  }
}

HF_AVX512 void dequant_f32_avx512(const int8_t* q, int64_t ldq, const float* scale, int64_t ld_scale, int64_t group,
                                  int cols, int64_t k, float* dst) {
  dequant_rows(q, ldq, scale, ld_scale, group, cols, k, dst);
}

HF_AVX512 void dequant_bf16_avx512(const int8_t* q, int64_t ldq, const float* scale, int64_t ld_scale, int64_t group,
                                   int cols, int64_t k, uint16_t* dst) {
  dequant_rows(q, ldq, scale, ld_scale, group, cols, k, dst);
}

}  // namespace infer
}  // namespace hf_moe

#endif
