// What the AVX-512 kernels of several files share: the target attribute, e^x, horizontal sums, and the run-time
// CPU check.
//
// Everything here has internal linkage (static, or an anonymous namespace), so a copy compiled for AVX-512 in one
// file is never merged by the linker with code a non-AVX-512 caller runs. Callers check `cpu_has_avx512_bf16()`
// once before any AVX-512 function runs.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#define HF_MOE_HAS_AVX512_KERNELS 1
#define HF_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

#include <immintrin.h>

namespace hf_moe {
namespace infer {
namespace {

// e^x to about 1 ulp over fp32's range (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial).
HF_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447504019f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// The first n (< 16) lanes, or all 16.
HF_AVX512 inline __mmask16 lanes16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// Four horizontal sums at once: [sum(a), sum(b), sum(c), sum(d)].
HF_AVX512 inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

template <int MR, int NR>
HF_AVX512 inline void store_tile(__m512 (&acc)[MR][NR], float* out, int64_t ldo) {
  for (int m = 0; m < MR; ++m) {
    if constexpr (NR == 4) {
      _mm_storeu_ps(out + m * ldo, reduce4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
    } else {
      for (int j = 0; j < NR; ++j) out[m * ldo + j] = _mm512_reduce_add_ps(acc[m][j]);
    }
  }
}

inline bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

}  // namespace
}  // namespace infer
}  // namespace hf_moe
#endif
