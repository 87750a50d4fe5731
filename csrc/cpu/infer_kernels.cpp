// Inner kernels of the inference experts op: portable C++, and AVX-512 (F, BW, VL, DQ, BF16) compiled for that
// target function by function (no global -mavx512 flag), used only where the CPU reports the instructions.
// See infer_kernels.h for what each kernel computes; the AVX-512 int8 ones are in infer_kernels_q8.cpp.
//
// The AVX-512 functions live in an anonymous namespace (but for the int8 entry points, defined once, there) and use
// only intrinsics and raw pointers: nothing compiled for AVX-512 can be merged by the linker with a copy that a
// non-AVX-512 caller would run.

#include "infer_kernels.h"
#include "infer_kernels_avx2.h"
#include "infer_kernels_q8.h"
#include "simd_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include <c10/util/Exception.h>

namespace hf_moe {
namespace infer {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Portable C++: the same results up to the order of the fp32 additions.
// ---------------------------------------------------------------------------------------------------------------
inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {  // round to nearest even, as c10::BFloat16
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float act_scalar(float g, Activation act) {
  switch (act) {
    case Activation::Silu: return g / (1.0f + std::exp(-g));
    case Activation::Gelu: return 0.5f * g * (1.0f + std::erf(g * 0.70710678118654752f));
    case Activation::GeluTanh: {
      const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
      return 0.5f * g * (1.0f + std::tanh(y));
    }
    case Activation::Relu: return g > 0.0f ? g : 0.0f;
    case Activation::Relu2: return g > 0.0f ? g * g : 0.0f;
  }
  return g;
}

template <typename T, typename Load>
void dot_portable(const T* x, int64_t ldx, int64_t rows, const T* w, int64_t ldw, int cols, int64_t k, float* out,
                  int64_t ldo, Load load) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int j = 0; j < cols; ++j) {
      float acc = 0.0f;
      const T* xr = x + m * ldx;
      const T* wr = w + j * ldw;
      for (int64_t c = 0; c < k; ++c) acc += load(xr[c]) * load(wr[c]);
      out[m * ldo + j] = acc;
    }
  }
}

void dot_f32_portable(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t ldw, int cols, int64_t k,
                      float* out, int64_t ldo) {
  dot_portable(x, ldx, rows, w, ldw, cols, k, out, ldo, [](float v) { return v; });
}

void dot_bf16_portable(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t ldw, int cols,
                       int64_t k, float* out, int64_t ldo) {
  dot_portable(x, ldx, rows, w, ldw, cols, k, out, ldo, bf16_bits_to_float);
}

void dot_q8_portable(const float* x, int64_t ldx, int64_t rows, const int8_t* q, int64_t ldq, const float* scale,
                     int64_t ld_scale, int64_t group, int cols, int64_t k, float* out, int64_t ldo) {
  for (int64_t m = 0; m < rows; ++m)
    for (int j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (int64_t g0 = 0; g0 < k; g0 += group) {
        const float s = scale[j * ld_scale + g0 / group];
        for (int64_t c = g0; c < std::min(k, g0 + group); ++c)
          acc += x[m * ldx + c] * (static_cast<float>(q[j * ldq + c]) * s);
      }
      out[m * ldo + j] = acc;
    }
}

void dequant_f32_portable(const int8_t* q, int64_t ldq, const float* scale, int64_t ld_scale, int64_t group, int cols,
                          int64_t k, float* dst) {
  for (int j = 0; j < cols; ++j)
    for (int64_t g0 = 0; g0 < k; g0 += group) {
      const float s = scale[j * ld_scale + g0 / group];
      for (int64_t c = g0; c < std::min(k, g0 + group); ++c) dst[j * k + c] = static_cast<float>(q[j * ldq + c]) * s;
    }
}

void dequant_bf16_portable(const int8_t* q, int64_t ldq, const float* scale, int64_t ld_scale, int64_t group,
                           int cols, int64_t k, uint16_t* dst) {
  for (int j = 0; j < cols; ++j)
    for (int64_t g0 = 0; g0 < k; g0 += group) {
      const float s = scale[j * ld_scale + g0 / group];
      for (int64_t c = g0; c < std::min(k, g0 + group); ++c)
        dst[j * k + c] = float_to_bf16_bits(static_cast<float>(q[j * ldq + c]) * s);
    }
}

void to_bf16_portable(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16_bits(src[i]);
}

}  // namespace

void activate_portable(const float* g, const float* u, float scale, int64_t n, Activation act, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = act_scalar(g[i], act) * (u ? u[i] : 1.0f) * scale;
}

namespace {

void gemm_f32_portable(const float* w, int64_t ldw, int cols, const float* packed, int64_t ld, int64_t rows,
                       int64_t k, float* out, int64_t ldo) {
  for (int j = 0; j < cols; ++j)
    for (int64_t m = 0; m < rows; ++m) {
      float acc = 0.0f;
      for (int64_t c = 0; c < k; ++c) acc += w[j * ldw + c] * packed[packed_index_f32(c, m, ld)];
      out[m * ldo + j] = acc;
    }
}

void gemm_bf16_portable(const uint16_t* w, int64_t ldw, int cols, const uint16_t* packed, int64_t ld, int64_t rows,
                        int64_t k, float* out, int64_t ldo) {
  for (int j = 0; j < cols; ++j)
    for (int64_t m = 0; m < rows; ++m) {
      float acc = 0.0f;
      for (int64_t c = 0; c < k; ++c)
        acc += bf16_bits_to_float(w[j * ldw + c]) * bf16_bits_to_float(packed[packed_index_bf16(c, m, ld)]);
      out[m * ldo + j] = acc;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// AVX-512 with BF16
// ---------------------------------------------------------------------------------------------------------------
#ifdef HF_MOE_HAS_AVX512_KERNELS  // (simd_avx512.h)

// What the fp32 and bf16 dot kernels differ in: the inputs one vector holds, and the multiply-add into fp32 sums
// (fp32: vfmadd, 16 inputs; bf16: vdpbf16ps, pairs of inputs, 32).
struct LanesF32 {
  using T = float;
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kLanes = 16;
  HF_AVX512 static Mask mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
  HF_AVX512 static V load(const T* p) { return _mm512_loadu_ps(p); }
  HF_AVX512 static V load(Mask m, const T* p) { return _mm512_maskz_loadu_ps(m, p); }
  HF_AVX512 static __m512 madd(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};

struct LanesBF16 {
  using T = uint16_t;
  using V = __m512bh;
  using Mask = __mmask32;
  static constexpr int64_t kLanes = 32;
  HF_AVX512 static Mask mask(int64_t n) { return static_cast<__mmask32>((1ull << n) - 1ull); }
  HF_AVX512 static V load(const T* p) { return (__m512bh)_mm512_loadu_si512(p); }
  HF_AVX512 static V load(Mask m, const T* p) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }
  HF_AVX512 static __m512 madd(__m512 acc, V x, V w) { return _mm512_dpbf16_ps(acc, x, w); }
};

// One activation row (a decode step) against NR weight rows, the rows one after the other: the weights are read in
// memory order, one stream, which the hardware prefetchers follow. Reading the NR rows side by side (NR streams of
// 18 to 48 cache lines each, as the tile below does) starved them, and a layer call read its weights markedly slower
// (benchmarks/experts_kernels.py --tokens 1; the numbers: docs/serving-cpu.md, "The decode kernels read their weights
// in memory order"). Each row's sum runs in the same order as the tile's, so a token's output is the same bits
// whatever the batch.
template <class L, int NR>
HF_AVX512 void dot_rows1(const typename L::T* x, const typename L::T* w, int64_t ldw, int64_t k,
                         __m512 (&acc)[1][NR]) {
  const int64_t body = k & ~(L::kLanes - 1);
  const typename L::Mask mask = L::mask(k - body);
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) {
    const typename L::T* row = w + j * ldw;
    __m512 a = _mm512_setzero_ps();
    for (int64_t c = 0; c < body; c += L::kLanes) a = L::madd(a, L::load(x + c), L::load(row + c));
    if (body < k) a = L::madd(a, L::load(mask, x + body), L::load(mask, row + body));
    acc[0][j] = a;
  }
}

// One register tile: MR activation rows against NR weight rows, over all of K. One row: dot_rows1.
template <class L, int MR, int NR>
HF_AVX512 void dot_tile(const typename L::T* x, int64_t ldx, const typename L::T* w, int64_t ldw, int64_t k,
                        float* out, int64_t ldo) {
  __m512 acc[MR][NR];
  if constexpr (MR == 1) {
    dot_rows1<L, NR>(x, w, ldw, k, acc);
    store_tile<MR, NR>(acc, out, ldo);
    return;
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + L::kLanes <= k; c += L::kLanes) {
    typename L::V wv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) wv[j] = L::load(w + j * ldw + c);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const typename L::V xv = L::load(x + m * ldx + c);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[m][j] = L::madd(acc[m][j], xv, wv[j]);
    }
  }
  if (c < k) {
    const typename L::Mask mask = L::mask(k - c);
    typename L::V wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = L::load(mask, w + j * ldw + c);
    for (int m = 0; m < MR; ++m) {
      const typename L::V xv = L::load(mask, x + m * ldx + c);
      for (int j = 0; j < NR; ++j) acc[m][j] = L::madd(acc[m][j], xv, wv[j]);
    }
  }
  store_tile<MR, NR>(acc, out, ldo);
}

template <class L>
HF_AVX512 void dot_rows(const typename L::T* x, int64_t ldx, int64_t rows, const typename L::T* w, int64_t ldw,
                        int cols, int64_t k, float* out, int64_t ldo) {
  for (int64_t m0 = 0; m0 < rows; m0 += kTile) {
    const int mr = static_cast<int>(std::min<int64_t>(kTile, rows - m0));
    const typename L::T* xm = x + m0 * ldx;
    float* om = out + m0 * ldo;
#define HF_MOE_TILE(MR)                                                  \
  switch (cols) {                                                        \
    case 1: dot_tile<L, MR, 1>(xm, ldx, w, ldw, k, om, ldo); break;      \
    case 2: dot_tile<L, MR, 2>(xm, ldx, w, ldw, k, om, ldo); break;      \
    case 3: dot_tile<L, MR, 3>(xm, ldx, w, ldw, k, om, ldo); break;      \
    default: dot_tile<L, MR, 4>(xm, ldx, w, ldw, k, om, ldo); break;     \
  }
    switch (mr) {
      case 1: HF_MOE_TILE(1) break;
      case 2: HF_MOE_TILE(2) break;
      case 3: HF_MOE_TILE(3) break;
      default: HF_MOE_TILE(4) break;
    }
#undef HF_MOE_TILE
  }
}

HF_AVX512 void dot_f32_avx512(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t ldw, int cols,
                              int64_t k, float* out, int64_t ldo) {
  dot_rows<LanesF32>(x, ldx, rows, w, ldw, cols, k, out, ldo);
}

HF_AVX512 void dot_bf16_avx512(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t ldw, int cols,
                               int64_t k, float* out, int64_t ldo) {
  dot_rows<LanesBF16>(x, ldx, rows, w, ldw, cols, k, out, ldo);
}

HF_AVX512 void to_bf16_avx512(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i));
    _mm256_mask_storeu_epi16(dst + i, mask, (__m256i)v);
  }
}

HF_AVX512 inline __m512 act512(__m512 g, Activation act) {
  const __m512 one = _mm512_set1_ps(1.0f);
  switch (act) {
    case Activation::Silu:  // g * sigmoid(g)
      return _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    case Activation::GeluTanh: {  // 0.5 g (1 + tanh(y)) = g * sigmoid(2y), y = sqrt(2/pi) (g + 0.044715 g^3)
      const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
      const __m512 y2 = _mm512_mul_ps(_mm512_set1_ps(-2.0f * 0.7978845608028654f),
                                      _mm512_fmadd_ps(g3, _mm512_set1_ps(0.044715f), g));
      return _mm512_div_ps(g, _mm512_add_ps(one, exp512(y2)));
    }
    case Activation::Relu: return _mm512_max_ps(g, _mm512_setzero_ps());
    case Activation::Relu2: {
      const __m512 r = _mm512_max_ps(g, _mm512_setzero_ps());
      return _mm512_mul_ps(r, r);
    }
    default: return g;  // Gelu (erf) runs in the portable kernel
  }
}

HF_AVX512 void activate_avx512(const float* g, const float* u, float scale, int64_t n, Activation act, float* out) {
  if (act == Activation::Gelu) {
    activate_portable(g, u, scale, n, act, out);
    return;
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1u);
    __m512 v = _mm512_mul_ps(act512(_mm512_maskz_loadu_ps(mask, g + i), act), s);
    if (u) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, u + i));
    _mm512_mask_storeu_ps(out + i, mask, v);
  }
}

// GEMM register tile: NJ weight rows x MB activation rows (16 or 32: one or two vectors), over all of K. Each weight
// value (fp32) or pair of values (bf16) is broadcast against MB packed activations. Results are scattered to
// out[m * ldo + j] (the tile's outputs are few next to its products: K / 2 * NJ * MB / 16 vdpbf16ps).
template <int NJ, int MB>
HF_AVX512 inline void store_gemm_tile(__m512 (&acc)[NJ][2], int64_t rows, float* out, int64_t ldo) {
  const __m512i index = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(static_cast<int>(ldo)));
  for (int b = 0; b < MB / 16; ++b) {
    const int64_t left = rows - 16 * b;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1u);
    float* base = out + 16 * b * ldo;
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j) _mm512_mask_i32scatter_ps(base + j, mask, index, acc[j][b], 4);
  }
}

template <int NJ, int MB>
HF_AVX512 void gemm_tile_f32(const float* w, int64_t ldw, const float* packed, int64_t ld, int64_t rows, int64_t k,
                             float* out, int64_t ldo) {
  __m512 acc[NJ][2];
#pragma GCC unroll 8
  for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; ++c) {
    const __m512 x0 = _mm512_loadu_ps(packed + c * ld);
    const __m512 x1 = MB == 32 ? _mm512_loadu_ps(packed + c * ld + 16) : x0;
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j) {
      const __m512 a = _mm512_set1_ps(w[j * ldw + c]);
      acc[j][0] = _mm512_fmadd_ps(a, x0, acc[j][0]);
      if (MB == 32) acc[j][1] = _mm512_fmadd_ps(a, x1, acc[j][1]);
    }
  }
  store_gemm_tile<NJ, MB>(acc, rows, out, ldo);
}

template <int NJ, int MB>
HF_AVX512 void gemm_tile_bf16(const uint16_t* w, int64_t ldw, const uint16_t* packed, int64_t ld, int64_t rows,
                              int64_t k, float* out, int64_t ldo) {
  __m512 acc[NJ][2];
#pragma GCC unroll 8
  for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* xp = packed + p * 2 * ld;
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xp);
    const __m512bh x1 = MB == 32 ? (__m512bh)_mm512_loadu_si512(xp + 32) : x0;
#pragma GCC unroll 8
    for (int j = 0; j < NJ; ++j) {
      int32_t pair;
      std::memcpy(&pair, w + j * ldw + 2 * p, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[j][0] = _mm512_dpbf16_ps(acc[j][0], a, x0);
      if (MB == 32) acc[j][1] = _mm512_dpbf16_ps(acc[j][1], a, x1);
    }
  }
  if (k % 2) {  // the last input alone: its partner is zero in the packed activations (and here)
    const uint16_t* xp = packed + pairs * 2 * ld;
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xp);
    const __m512bh x1 = MB == 32 ? (__m512bh)_mm512_loadu_si512(xp + 32) : x0;
    for (int j = 0; j < NJ; ++j) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w[j * ldw + k - 1]));
      acc[j][0] = _mm512_dpbf16_ps(acc[j][0], a, x0);
      if (MB == 32) acc[j][1] = _mm512_dpbf16_ps(acc[j][1], a, x1);
    }
  }
  store_gemm_tile<NJ, MB>(acc, rows, out, ldo);
}

// All rows and `cols` weight rows: tiles of 8 (then 4, 2, 1) weight rows x 32 (then 16) activation rows. The packed
// activations of one 32-row block are reused for every weight tile while they sit in L1.
template <typename T, template <int, int> class Tile>
HF_AVX512 void gemm_all(const T* w, int64_t ldw, int cols, const T* packed, int64_t ld, int64_t rows, int64_t k,
                        float* out, int64_t ldo) {
  const int64_t pair = std::is_same_v<T, float> ? 1 : 2;  // packed values per activation row and input pair
  for (int64_t m0 = 0; m0 < rows; m0 += 32) {
    const int64_t left = rows - m0;
    const T* xp = packed + m0 * pair;
    float* om = out + m0 * ldo;
    int j = 0;
#define HF_MOE_GEMM(NJ)                                                                  \
  if (left > 16) Tile<NJ, 32>::run(w + j * ldw, ldw, xp, ld, left, k, om + j, ldo);       \
  else Tile<NJ, 16>::run(w + j * ldw, ldw, xp, ld, left, k, om + j, ldo);                 \
  j += NJ;
    while (cols - j >= 8) { HF_MOE_GEMM(8) }
    if (cols - j >= 4) { HF_MOE_GEMM(4) }
    if (cols - j >= 2) { HF_MOE_GEMM(2) }
    if (cols - j >= 1) { HF_MOE_GEMM(1) }
#undef HF_MOE_GEMM
  }
}

template <int NJ, int MB>
struct GemmF32 {
  HF_AVX512 static void run(const float* w, int64_t ldw, const float* packed, int64_t ld, int64_t rows, int64_t k,
                            float* out, int64_t ldo) {
    gemm_tile_f32<NJ, MB>(w, ldw, packed, ld, rows, k, out, ldo);
  }
};

template <int NJ, int MB>
struct GemmBF16 {
  HF_AVX512 static void run(const uint16_t* w, int64_t ldw, const uint16_t* packed, int64_t ld, int64_t rows,
                            int64_t k, float* out, int64_t ldo) {
    gemm_tile_bf16<NJ, MB>(w, ldw, packed, ld, rows, k, out, ldo);
  }
};

HF_AVX512 void gemm_f32_avx512(const float* w, int64_t ldw, int cols, const float* packed, int64_t ld, int64_t rows,
                               int64_t k, float* out, int64_t ldo) {
  gemm_all<float, GemmF32>(w, ldw, cols, packed, ld, rows, k, out, ldo);
}

HF_AVX512 void gemm_bf16_avx512(const uint16_t* w, int64_t ldw, int cols, const uint16_t* packed, int64_t ld,
                                int64_t rows, int64_t k, float* out, int64_t ldo) {
  gemm_all<uint16_t, GemmBF16>(w, ldw, cols, packed, ld, rows, k, out, ldo);
}

#endif

const Kernels kPortable{"portable",           8,
                        dot_f32_portable,     dot_bf16_portable, dot_q8_portable,   dequant_f32_portable,
                        dequant_bf16_portable, to_bf16_portable, gemm_f32_portable, gemm_bf16_portable,
                        activate_portable};
#ifdef HF_MOE_HAS_AVX512_KERNELS
const Kernels kAvx512Table{"avx512_bf16",       8,
                           dot_f32_avx512,      dot_bf16_avx512, dot_q8_avx512,   dequant_f32_avx512,
                           dequant_bf16_avx512, to_bf16_avx512,  gemm_f32_avx512, gemm_bf16_avx512,
                           activate_avx512};
const Kernels* const kAvx512 = &kAvx512Table;
#else
const Kernels* const kAvx512 = nullptr;
#endif
#ifdef HF_MOE_HAS_AVX2_KERNELS
// AVX2 for the kernels that do one operation per weight per token, for dequantizing to fp32 (a prefill's, on such a
// CPU: infer_cpu.cpp), and for the activations and the rounding to bf16 (their scalar loops showed in a decode
// step's profile: docs/serving-cpu.md); the portable one for dequantizing to bf16.
const Kernels kAvx2Table{"avx2",           12,
                         dot_f32_avx2,     dot_bf16_avx2,         dot_q8_avx2,      dequant_f32_avx2,
                         dequant_bf16_portable, to_bf16_avx2,     gemm_f32_avx2,    gemm_bf16_avx2,
                         activate_avx2};
const Kernels* const kAvx2 = &kAvx2Table;
#else
const Kernels* const kAvx2 = nullptr;
#endif

}  // namespace

bool avx2_kernels(const std::string& name) {
#ifdef HF_MOE_HAS_AVX2_KERNELS
  static const bool avx2 = cpu_has_avx2_fma();
  if (avx2) return name == "auto" || name == "avx2";
#endif
  TORCH_CHECK(name != "avx2", "hf_moe: this CPU lacks AVX2 with FMA; use the 'auto' or 'portable' kernels");
  return false;
}

bool avx512_kernels(const std::string& name) {
  if (name == "portable" || name == "avx2") return false;
  TORCH_CHECK(name == "auto" || name == "avx512_bf16", "hf_moe: unknown kernel set '", name,
              "' (auto, avx512_bf16, avx2 or portable)");
#ifdef HF_MOE_HAS_AVX512_KERNELS
  static const bool avx512 = cpu_has_avx512_bf16();
  if (avx512) return true;
#endif
  TORCH_CHECK(name == "auto", "hf_moe: this CPU lacks AVX-512 with BF16; use the 'auto' or 'portable' kernels");
  return false;
}

const Kernels& infer_kernels(const std::string& name) {
  return pick_kernels(name, avx2_kernels(name) && kAvx2 != nullptr ? *kAvx2 : kPortable, kAvx512);
}

}  // namespace infer
}  // namespace hf_moe
