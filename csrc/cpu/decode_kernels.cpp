// Inner kernels of decode attention (see decode_kernels.h): the softmax's exponentials and the weighted sum of value
// rows. Portable C++, and AVX-512 and AVX2 compiled for those targets function by function (simd_avx512.h,
// simd_avx2.h).

#include "decode_kernels.h"
#include "infer_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "simd_avx2.h"
#include "simd_avx512.h"

namespace hf_moe {
namespace infer {
namespace {

float exp_sum_portable(float* x, int64_t n, float shift) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::isinf(x[i]) && x[i] < 0 ? 0.0f : std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

void accumulate_f32_portable(const float* p, int64_t n, const float* v, int64_t ldv, int64_t d, float* acc) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < d; ++c) acc[c] += p[j] * v[j * ldv + c];
}

void accumulate_bf16_portable(const float* p, int64_t n, const uint16_t* v, int64_t ldv, int64_t d, float* acc) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < d; ++c) acc[c] += p[j] * bf16_to_float(v[j * ldv + c]);
}

#ifdef HF_MOE_HAS_AVX512_KERNELS
HF_AVX512 float exp_sum_avx512(float* x, int64_t n, float shift) {
  const __m512 s = _mm512_set1_ps(shift), minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = lanes16(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(lanes, x + i);
    const __mmask16 valid = _mm512_mask_cmp_ps_mask(lanes, v, minus_inf, _CMP_GT_OQ);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(v, s)));
    _mm512_mask_storeu_ps(x + i, lanes, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// Value rows as fp32, 16 columns at a time: fp32 loaded as they are, bf16 widened (their bits, shifted).
HF_AVX512 inline __m512 load16(const float* v, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, v); }
HF_AVX512 inline __m512 load16(const uint16_t* v, __mmask16 lanes) {
  const __m256i bits = _mm256_maskz_loadu_epi16(lanes, v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Four vectors (64 columns) of acc stay in registers while every row is added in.
template <typename T>
HF_AVX512 void accumulate_avx512(const float* p, int64_t n, const T* v, int64_t ldv, int64_t d, float* acc) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    __mmask16 lanes[4];
    __m512 a[4];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      lanes[t] = c0 + 16 * t < d ? lanes16(d - c0 - 16 * t) : static_cast<__mmask16>(0);
      a[t] = _mm512_maskz_loadu_ps(lanes[t], acc + c0 + 16 * t);
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j]);
      const T* row = v + j * ldv + c0;
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) a[t] = _mm512_fmadd_ps(pj, load16(row + 16 * t, lanes[t]), a[t]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) _mm512_mask_storeu_ps(acc + c0 + 16 * t, lanes[t], a[t]);
  }
}

HF_AVX512 void accumulate_f32_avx512(const float* p, int64_t n, const float* v, int64_t ldv, int64_t d, float* acc) {
  accumulate_avx512(p, n, v, ldv, d, acc);
}

HF_AVX512 void accumulate_bf16_avx512(const float* p, int64_t n, const uint16_t* v, int64_t ldv, int64_t d,
                                      float* acc) {
  accumulate_avx512(p, n, v, ldv, d, acc);
}
#endif

#ifdef HF_MOE_HAS_AVX2_KERNELS
HF_AVX2 float exp_sum_avx2(float* x, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift), minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 sum = _mm256_setzero_ps();
  float tail[8];
  for (int64_t i = 0; i < n; i += 8) {
    const bool whole = i + 8 <= n;  // the last few values go through a copy padded with -inf (masked: 0)
    if (!whole) {
      std::fill_n(tail, 8, -std::numeric_limits<float>::infinity());
      std::memcpy(tail, x + i, (n - i) * sizeof(float));
    }
    const __m256 v = _mm256_loadu_ps(whole ? x + i : tail);
    const __m256 e = _mm256_and_ps(_mm256_cmp_ps(v, minus_inf, _CMP_GT_OQ), exp256(_mm256_sub_ps(v, s)));
    _mm256_storeu_ps(whole ? x + i : tail, e);
    if (!whole) std::memcpy(x + i, tail, (n - i) * sizeof(float));
    sum = _mm256_add_ps(sum, e);
  }
  return hsum(sum);
}

// Eight vectors (64 columns) of acc stay in registers while every row is added in, one FMA per value as the AVX-512
// kernel adds them; the columns past the last multiple of eight, one fused multiply-add each.
// L: how the value rows load (simd_avx2.h's F32 or BF16).
template <class L>
HF_AVX2 void accumulate_avx2(const float* p, int64_t n, const typename L::T* v, int64_t ldv, int64_t d, float* acc) {
  int64_t c0 = 0;
  for (; c0 + 64 <= d; c0 += 64) {
    __m256 a[8];
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) a[t] = _mm256_loadu_ps(acc + c0 + 8 * t);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const typename L::T* row = v + j * ldv + c0;
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(pj, L::load8(row + 8 * t), a[t]);
    }
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) _mm256_storeu_ps(acc + c0 + 8 * t, a[t]);
  }
  for (; c0 + 8 <= d; c0 += 8) {
    __m256 a = _mm256_loadu_ps(acc + c0);
    for (int64_t j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), L::load8(v + j * ldv + c0), a);
    _mm256_storeu_ps(acc + c0, a);
  }
  for (; c0 < d; ++c0)
    for (int64_t j = 0; j < n; ++j) acc[c0] = std::fma(p[j], L::one(v[j * ldv + c0]), acc[c0]);
}

HF_AVX2 void accumulate_f32_avx2(const float* p, int64_t n, const float* v, int64_t ldv, int64_t d, float* acc) {
  accumulate_avx2<F32>(p, n, v, ldv, d, acc);
}

HF_AVX2 void accumulate_bf16_avx2(const float* p, int64_t n, const uint16_t* v, int64_t ldv, int64_t d, float* acc) {
  accumulate_avx2<BF16>(p, n, v, ldv, d, acc);
}
#endif

const AttentionKernels kPortable{"portable", exp_sum_portable, accumulate_f32_portable, accumulate_bf16_portable};
#ifdef HF_MOE_HAS_AVX2_KERNELS
const AttentionKernels kAvx2{"avx2", exp_sum_avx2, accumulate_f32_avx2, accumulate_bf16_avx2};
#endif
#ifdef HF_MOE_HAS_AVX512_KERNELS
const AttentionKernels kAvx512Table{"avx512_bf16", exp_sum_avx512, accumulate_f32_avx512, accumulate_bf16_avx512};
const AttentionKernels* const kAvx512 = &kAvx512Table;
#else
const AttentionKernels* const kAvx512 = nullptr;
#endif

}  // namespace

const AttentionKernels& attention_kernels(const std::string& name) {
#ifdef HF_MOE_HAS_AVX2_KERNELS
  if (!avx512_kernels(name) && avx2_kernels(name)) return kAvx2;
#endif
  return pick_kernels(name, kPortable, kAvx512);
}

}  // namespace infer
}  // namespace hf_moe
