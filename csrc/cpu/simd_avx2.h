// What the AVX2 kernels of several files share: the target attribute, the loads of each element type, the horizontal
// sum, and e^x (infer_kernels_avx2.cpp: the dot products, GEMMs and activations; decode_kernels.cpp: decode
// attention's softmax and weighted sum of values).
//
// Everything here has internal linkage (an anonymous namespace), so a copy compiled for AVX2 in one file is never
// merged by the linker with code a CPU without AVX2 runs. Callers check `cpu_has_avx2_fma()` once before any AVX2
// function runs.
#pragma once

#include "infer_kernels_avx2.h"

#ifdef HF_MOE_HAS_AVX2_KERNELS

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define HF_AVX2 __attribute__((target("avx2,fma")))

namespace hf_moe {
namespace infer {
namespace {

// How each element type loads: eight values as fp32 lanes, and one as a float (the tails).
struct F32 {
  using T = float;
  HF_AVX2 static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static float one(float v) { return v; }
};

struct BF16 {  // bf16 bits: the upper half of an fp32
  using T = uint16_t;
  HF_AVX2 static __m256 load8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static float one(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
};

struct Q8 {
  using T = int8_t;
  HF_AVX2 static __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static float one(int8_t v) { return static_cast<float>(v); }
};

// The sum of the eight lanes.
HF_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 2^e for integer lanes -126 <= e <= 127, as an fp32 (its exponent field).
HF_AVX2 inline __m256 pow2_256(__m256i e) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
}

// e^x with exp512's operations (simd_avx512.h) on eight lanes, so both CPUs give the same bits: x = n ln2 + r, a
// degree-5 polynomial in r, scaled by 2^n. AVX2 has no scalef, and n reaches 128 (one past the largest exponent a
// float holds), so the scaling is two exact halves: p 2^(n/2) is a normal number, and the second product rounds once,
// as scalef does.
HF_AVX2 inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504019f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2_256(half)), pow2_256(_mm256_sub_epi32(whole, half)));
}

}  // namespace
}  // namespace infer
}  // namespace hf_moe
#endif
