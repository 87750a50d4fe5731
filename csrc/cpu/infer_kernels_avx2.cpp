// The AVX2 (with FMA) dot-product and GEMM kernels of the inference ops (infer_kernels.h says what each computes;
// the portable ones, the reference, are in infer_kernels.cpp). Compiled for that target function by function (no
// global -mavx2 flag) and called only where the CPU reports the instructions (`infer_kernels`): the portable kernels
// are scalar loops (a compiler does not reorder a float sum to vectorize it), and a decode step on a CPU without
// AVX-512 spent most of its time in them (docs/serving-cpu.md, "CPUs without AVX-512").
//
// The helpers live in an anonymous namespace and use only intrinsics and raw pointers, so nothing compiled for AVX2
// is merged by the linker with a copy that a CPU without it would run.

#include "infer_kernels_avx2.h"
#include "infer_kernels.h"

#ifdef HF_MOE_HAS_AVX2_KERNELS

#include <immintrin.h>

#include <algorithm>
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

HF_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_c x[c] * w[c] for c < n: four sums of eight lanes (four FMAs in flight), added at the end.
template <class LX, class LW>
HF_AVX2 inline float dot(const typename LX::T* x, const typename LW::T* w, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    a0 = _mm256_fmadd_ps(LX::load8(x + c), LW::load8(w + c), a0);
    a1 = _mm256_fmadd_ps(LX::load8(x + c + 8), LW::load8(w + c + 8), a1);
    a2 = _mm256_fmadd_ps(LX::load8(x + c + 16), LW::load8(w + c + 16), a2);
    a3 = _mm256_fmadd_ps(LX::load8(x + c + 24), LW::load8(w + c + 24), a3);
  }
  for (; c + 8 <= n; c += 8) a0 = _mm256_fmadd_ps(LX::load8(x + c), LW::load8(w + c), a0);
  float sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; c < n; ++c) sum += LX::one(x[c]) * LW::one(w[c]);
  return sum;
}

// Weight rows one after the other, in memory order (as the AVX-512 decode kernels read them, for the hardware
// prefetchers: infer_kernels.cpp).
template <class L>
HF_AVX2 void dot_all(const typename L::T* x, int64_t ldx, int64_t rows, const typename L::T* w, int64_t ldw, int cols,
                     int64_t k, float* out, int64_t ldo) {
  for (int j = 0; j < cols; ++j)
    for (int64_t m = 0; m < rows; ++m) out[m * ldo + j] = dot<L, L>(x + m * ldx, w + j * ldw, k);
}

// NJ weight rows against 16 packed activation rows from m0 (two vectors of eight), into out. The packed rows are
// zero past `rows` and `ld` is a multiple of 16, so the loads stay inside; only the real rows are stored.
template <int NJ>
HF_AVX2 void store_tile(const __m256 (&acc)[NJ][2], int64_t m0, int64_t rows, int j0, float* out, int64_t ldo) {
  const int64_t n = std::min<int64_t>(16, rows - m0);
  for (int j = 0; j < NJ; ++j) {
    float lanes[16];
    _mm256_storeu_ps(lanes, acc[j][0]);
    _mm256_storeu_ps(lanes + 8, acc[j][1]);
    for (int64_t m = 0; m < n; ++m) out[(m0 + m) * ldo + j0 + j] = lanes[m];
  }
}

template <int NJ>
HF_AVX2 void gemm_tile(const float* w, int64_t ldw, const float* packed, int64_t ld, int64_t m0, int64_t rows,
                           int64_t k, int j0, float* out, int64_t ldo) {
  __m256 acc[NJ][2];
  for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < k; ++c) {
    const __m256 x0 = _mm256_loadu_ps(packed + c * ld + m0), x1 = _mm256_loadu_ps(packed + c * ld + m0 + 8);
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) {
      const __m256 wv = _mm256_set1_ps(w[(j0 + j) * ldw + c]);
      acc[j][0] = _mm256_fmadd_ps(wv, x0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(wv, x1, acc[j][1]);
    }
  }
  store_tile<NJ>(acc, m0, rows, j0, out, ldo);
}

// bf16 activations are packed in pairs of inputs (infer_kernels.h): eight 32-bit lanes hold inputs c and c + 1 of
// eight rows, c's bits in the low half and c + 1's in the high half, so a shift and a mask give both as fp32.
template <int NJ>
HF_AVX2 void gemm_tile(const uint16_t* w, int64_t ldw, const uint16_t* packed, int64_t ld, int64_t m0,
                            int64_t rows, int64_t k, int j0, float* out, int64_t ldo) {
  __m256 acc[NJ][2];
  for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t c = 0; c < k; c += 2) {
    const uint16_t* pair = packed + packed_index_bf16(c, m0, ld);
    __m256 even[2], odd[2];
    for (int b = 0; b < 2; ++b) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 16 * b));
      even[b] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      odd[b] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    }
    const bool two = c + 1 < k;  // past k the packed input is zero, but the weight row ends
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) {
      const uint16_t* row = w + (j0 + j) * ldw + c;
      const __m256 w0 = _mm256_set1_ps(BF16::one(row[0])), w1 = _mm256_set1_ps(two ? BF16::one(row[1]) : 0.0f);
      for (int b = 0; b < 2; ++b) acc[j][b] = _mm256_fmadd_ps(w1, odd[b], _mm256_fmadd_ps(w0, even[b], acc[j][b]));
    }
  }
  store_tile<NJ>(acc, m0, rows, j0, out, ldo);
}

// Every 16 activation rows against every four weight rows (the last tile with the weight rows left), fp32 or bf16
// by the overload of gemm_tile that T picks.
template <typename T>
HF_AVX2 void gemm_all(const T* w, int64_t ldw, int cols, const T* packed, int64_t ld, int64_t rows, int64_t k,
                      float* out, int64_t ldo) {
  for (int64_t m0 = 0; m0 < rows; m0 += 16)
    for (int j0 = 0; j0 < cols; j0 += 4) {
      switch (std::min(4, cols - j0)) {
        case 1: gemm_tile<1>(w, ldw, packed, ld, m0, rows, k, j0, out, ldo); break;
        case 2: gemm_tile<2>(w, ldw, packed, ld, m0, rows, k, j0, out, ldo); break;
        case 3: gemm_tile<3>(w, ldw, packed, ld, m0, rows, k, j0, out, ldo); break;
        default: gemm_tile<4>(w, ldw, packed, ld, m0, rows, k, j0, out, ldo); break;
      }
    }
}

}  // namespace

bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

HF_AVX2 void dot_f32_avx2(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t ldw, int cols, int64_t k,
                          float* out, int64_t ldo) {
  dot_all<F32>(x, ldx, rows, w, ldw, cols, k, out, ldo);
}

HF_AVX2 void dot_bf16_avx2(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t ldw, int cols,
                           int64_t k, float* out, int64_t ldo) {
  dot_all<BF16>(x, ldx, rows, w, ldw, cols, k, out, ldo);
}

// Each group's sum times its scale (one multiply per group, not per weight, as the AVX-512 kernel does with one
// scale per row): sum_g s_g sum_c x q, where dequantize-then-multiply computes sum x (q s); the two differ by fp32
// rounding.
HF_AVX2 void dot_q8_avx2(const float* x, int64_t ldx, int64_t rows, const int8_t* q, int64_t ldq, const float* scale,
                         int64_t ld_scale, int64_t group, int cols, int64_t k, float* out, int64_t ldo) {
  for (int j = 0; j < cols; ++j)
    for (int64_t m = 0; m < rows; ++m) {
      float acc = 0.0f;
      for (int64_t g0 = 0; g0 < k; g0 += group)
        acc += scale[j * ld_scale + g0 / group] * dot<F32, Q8>(x + m * ldx + g0, q + j * ldq + g0,
                                                               std::min(k, g0 + group) - g0);
      out[m * ldo + j] = acc;
    }
}

// Eight int8 values at a time, widened to fp32 and times their group's scale: the same product as the portable
// kernel's, so the same bits.
HF_AVX2 void dequant_f32_avx2(const int8_t* q, int64_t ldq, const float* scale, int64_t ld_scale, int64_t group,
                              int cols, int64_t k, float* dst) {
  for (int j = 0; j < cols; ++j)
    for (int64_t g0 = 0; g0 < k; g0 += group) {
      const float s = scale[j * ld_scale + g0 / group];
      const __m256 sv = _mm256_set1_ps(s);
      const int64_t end = std::min(k, g0 + group);
      const int8_t* row = q + j * ldq;
      float* out = dst + j * k;
      int64_t c = g0;
      for (; c + 8 <= end; c += 8) _mm256_storeu_ps(out + c, _mm256_mul_ps(Q8::load8(row + c), sv));
      for (; c < end; ++c) out[c] = static_cast<float>(row[c]) * s;
    }
}

HF_AVX2 void gemm_f32_avx2(const float* w, int64_t ldw, int cols, const float* packed, int64_t ld, int64_t rows,
                           int64_t k, float* out, int64_t ldo) {
  gemm_all(w, ldw, cols, packed, ld, rows, k, out, ldo);
}

HF_AVX2 void gemm_bf16_avx2(const uint16_t* w, int64_t ldw, int cols, const uint16_t* packed, int64_t ld,
                            int64_t rows, int64_t k, float* out, int64_t ldo) {
  gemm_all(w, ldw, cols, packed, ld, rows, k, out, ldo);
}

}  // namespace infer
}  // namespace hf_moe

#endif
