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
#include "simd_avx2.h"

#ifdef HF_MOE_HAS_AVX2_KERNELS

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace hf_moe {
namespace infer {
namespace {

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

// The GEMM register tile: NJ <= 6 weight rows against 16 packed activation rows from m0 (two vectors of eight),
// NJ x 2 fp32 sums. Six rows make 12 sums, with the two activation vectors and one broadcast weight 15 of AVX2's 16
// registers: enough independent FMAs in flight to cover their latency on two ports, where a tile of four rows (eight
// sums) left the FMA units idle part of the time (docs/serving-cpu.md, "A wider GEMM tile, and the prompt's linear
// layers"). Each sum adds its products in input order, one FMA after another, so the tile's width does not change a
// single bit.
constexpr int kTileRows = 6;

// The packed rows are zero past `rows` and `ld` is a multiple of 16, so the loads stay inside; only the real rows are
// stored. Inlined and unrolled, so that the compiler keeps the sums in registers through the loop (an array it
// could index at run time would live on the stack, stored back at every step).
template <int NJ>
HF_AVX2 __attribute__((always_inline)) inline void store_tile(const __m256 (&acc)[NJ][2], int64_t m0, int64_t rows,
                                                              float* out, int64_t ldo) {
  const int64_t n = std::min<int64_t>(16, rows - m0);
  float lanes[NJ][16];
#pragma GCC unroll 6
  for (int j = 0; j < NJ; ++j) {
    _mm256_storeu_ps(lanes[j], acc[j][0]);
    _mm256_storeu_ps(lanes[j] + 8, acc[j][1]);
  }
  for (int j = 0; j < NJ; ++j)
    for (int64_t m = 0; m < n; ++m) out[(m0 + m) * ldo + j] = lanes[j][m];
}

// fp32: w holds NJ fp32 weight rows (stride ldw), each value broadcast against 16 activation rows.
template <int NJ>
HF_AVX2 void gemm_tile(const float* w, int64_t ldw, const float* packed, int64_t ld, int64_t m0, int64_t rows,
                       int64_t k, float* out, int64_t ldo) {
  __m256 acc[NJ][2];
#pragma GCC unroll 6
  for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < k; ++c) {
    const __m256 x0 = _mm256_loadu_ps(packed + c * ld + m0), x1 = _mm256_loadu_ps(packed + c * ld + m0 + 8);
#pragma GCC unroll 6
    for (int j = 0; j < NJ; ++j) {
      const __m256 wv = _mm256_broadcast_ss(w + j * ldw + c);
      acc[j][0] = _mm256_fmadd_ps(wv, x0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(wv, x1, acc[j][1]);
    }
  }
  store_tile<NJ>(acc, m0, rows, out, ldo);
}

// bf16 activations are packed in pairs of inputs (infer_kernels.h): eight 32-bit lanes hold inputs c and c + 1 of
// eight rows, c's bits in the low half and c + 1's in the high half, so a shift gives input c as fp32 and a mask
// input c + 1. The weights come widened to fp32 (`wide`: NJ rows of k, exact), so each is one broadcast; the rows of
// input c go first and then those of c + 1, which keeps every sum's order. Sixteen registers: 12 sums, two activation
// vectors, a broadcast weight and the mask.
template <int NJ>
HF_AVX2 void gemm_tile(const float* wide, int64_t k, const uint16_t* packed, int64_t ld, int64_t m0, int64_t rows,
                       float* out, int64_t ldo) {
  __m256 acc[NJ][2];
#pragma GCC unroll 6
  for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t c = 0; c < k; c += 2) {
    const __m256i* pair = reinterpret_cast<const __m256i*>(packed + packed_index_bf16(c, m0, ld));
    __m256 x0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(pair), 16));
    __m256 x1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(pair + 1), 16));
#pragma GCC unroll 6
    for (int j = 0; j < NJ; ++j) {
      const __m256 wv = _mm256_broadcast_ss(wide + j * k + c);
      acc[j][0] = _mm256_fmadd_ps(wv, x0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(wv, x1, acc[j][1]);
    }
    if (c + 1 == k) break;  // past k the packed input is zero, but the weight rows end
    x0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(pair), high));
    x1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(pair + 1), high));
#pragma GCC unroll 6
    for (int j = 0; j < NJ; ++j) {
      const __m256 wv = _mm256_broadcast_ss(wide + j * k + c + 1);
      acc[j][0] = _mm256_fmadd_ps(wv, x0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(wv, x1, acc[j][1]);
    }
  }
  store_tile<NJ>(acc, m0, rows, out, ldo);
}

// Rows of bf16 bits widened to fp32 (exact): dst[j * k + c] = w[j * ldw + c], eight at a time.
HF_AVX2 void widen_bf16(const uint16_t* w, int64_t ldw, int rows, int64_t k, float* dst) {
  for (int j = 0; j < rows; ++j) {
    const uint16_t* src = w + j * ldw;
    float* row = dst + j * k;
    int64_t c = 0;
    for (; c + 8 <= k; c += 8) _mm256_storeu_ps(row + c, BF16::load8(src + c));
    for (; c < k; ++c) row[c] = BF16::one(src[c]);
  }
}

// How many weight rows the next tile takes, of `left`: six, but 8 as 4 + 4 (a 2-row tile's four sums would idle the
// FMA units more than two 4-row tiles' eight).
inline int tile_width(int left) { return left == 8 ? 4 : std::min(kTileRows, left); }

template <typename Tile>
void for_tile_width(int nj, Tile&& tile) {
  switch (nj) {
    case 1: tile(std::integral_constant<int, 1>()); break;
    case 2: tile(std::integral_constant<int, 2>()); break;
    case 3: tile(std::integral_constant<int, 3>()); break;
    case 4: tile(std::integral_constant<int, 4>()); break;
    case 5: tile(std::integral_constant<int, 5>()); break;
    default: tile(std::integral_constant<int, 6>()); break;
  }
}

// Per-thread room for one tile's weight rows widened to fp32 (bf16), grown on demand and kept.
float* wide_scratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// act(g) on eight lanes, with act512's operations (infer_kernels.cpp): erf GELU is not here (the portable kernel).
HF_AVX2 inline __m256 act256(__m256 g, Activation act) {
  const __m256 one = _mm256_set1_ps(1.0f);
  switch (act) {
    case Activation::Silu:  // g * sigmoid(g)
      return _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    case Activation::GeluTanh: {  // 0.5 g (1 + tanh(y)) = g * sigmoid(2y), y = sqrt(2/pi) (g + 0.044715 g^3)
      const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
      const __m256 y2 = _mm256_mul_ps(_mm256_set1_ps(-2.0f * 0.7978845608028654f),
                                      _mm256_fmadd_ps(g3, _mm256_set1_ps(0.044715f), g));
      return _mm256_div_ps(g, _mm256_add_ps(one, exp256(y2)));
    }
    case Activation::Relu: return _mm256_max_ps(g, _mm256_setzero_ps());
    case Activation::Relu2: {
      const __m256 r = _mm256_max_ps(g, _mm256_setzero_ps());
      return _mm256_mul_ps(r, r);
    }
    default: return g;
  }
}

// Eight fp32 lanes to bf16 bits, rounded to nearest even (NaN stays NaN, made quiet), as c10::BFloat16 rounds.
HF_AVX2 inline __m128i bf16_of(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  const __m256i high = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
  // (packus works within each 128-bit half: the two halves' four values are then brought together)
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08));
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

// Weight tiles outside, 16-row activation panels inside: a tile's rows (and, for bf16, their fp32 copy) stay in L1
// while the expert's panels stream past them.
HF_AVX2 void gemm_f32_avx2(const float* w, int64_t ldw, int cols, const float* packed, int64_t ld, int64_t rows,
                           int64_t k, float* out, int64_t ldo) {
  for (int j0 = 0, nj; j0 < cols; j0 += nj) {
    nj = tile_width(cols - j0);
    for_tile_width(nj, [&](auto n) {
      for (int64_t m0 = 0; m0 < rows; m0 += 16)
        gemm_tile<decltype(n)::value>(w + j0 * ldw, ldw, packed, ld, m0, rows, k, out + j0, ldo);
    });
  }
}

HF_AVX2 void gemm_bf16_avx2(const uint16_t* w, int64_t ldw, int cols, const uint16_t* packed, int64_t ld,
                            int64_t rows, int64_t k, float* out, int64_t ldo) {
  float* wide = wide_scratch(kTileRows * k);
  for (int j0 = 0, nj; j0 < cols; j0 += nj) {
    nj = tile_width(cols - j0);
    widen_bf16(w + j0 * ldw, ldw, nj, k, wide);
    for_tile_width(nj, [&](auto n) {
      for (int64_t m0 = 0; m0 < rows; m0 += 16)
        gemm_tile<decltype(n)::value>(wide, k, packed, ld, m0, rows, out + j0, ldo);
    });
  }
}

HF_AVX2 void to_bf16_avx2(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), bf16_of(_mm256_loadu_ps(src + i)));
  if (i == n) return;
  float tail[8] = {};
  uint16_t bits[8];
  std::memcpy(tail, src + i, (n - i) * sizeof(float));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(bits), bf16_of(_mm256_loadu_ps(tail)));
  std::memcpy(dst + i, bits, (n - i) * sizeof(uint16_t));
}

HF_AVX2 void activate_avx2(const float* g, const float* u, float scale, int64_t n, Activation act, float* out) {
  if (act == Activation::Gelu) {
    activate_portable(g, u, scale, n, act, out);
    return;
  }
  const __m256 s = _mm256_set1_ps(scale);
  float tail_g[8] = {}, tail_u[8] = {}, tail_out[8];
  for (int64_t i = 0; i < n; i += 8) {
    const bool whole = i + 8 <= n;  // the last few values go through a zero-padded copy
    if (!whole) {
      std::memcpy(tail_g, g + i, (n - i) * sizeof(float));
      if (u) std::memcpy(tail_u, u + i, (n - i) * sizeof(float));
    }
    __m256 v = _mm256_mul_ps(act256(_mm256_loadu_ps(whole ? g + i : tail_g), act), s);
    if (u) v = _mm256_mul_ps(v, _mm256_loadu_ps(whole ? u + i : tail_u));
    _mm256_storeu_ps(whole ? out + i : tail_out, v);
    if (!whole) std::memcpy(out + i, tail_out, (n - i) * sizeof(float));
  }
}

}  // namespace infer
}  // namespace hf_moe

#endif
