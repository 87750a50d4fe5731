// Inner kernels of the inference experts op (infer_cpu.cpp), one set per instruction set: AVX-512 with BF16
// (vdpbf16ps) where the CPU has it, else AVX2 with FMA for the dot products and GEMMs (infer_kernels_avx2.h), else
// portable C++. Picked once at run time (`infer_kernels`), so the extension builds with the default flags and runs
// on any x86-64 or ARM CPU.
//
// Weights are in transformers' layout, [out, K] row-major (K contiguous), so every kernel is a dot product along
// K: one output row of the weight against each activation row. No packed copy of the weights is needed, and a
// weight row is read once per call whatever the number of activation rows (decode reads each weight once).
// bf16 values are passed as their bits (uint16_t); products accumulate in fp32.
#pragma once

#include <cstdint>
#include <string>

#include "../activation.h"
#include "infer_tile.h"

namespace hf_moe {
namespace infer {

// Experts with at least this many rows (prefill) take the GEMM kernels: their activations are packed once, k-major
// (`packed` below), and every weight row is broadcast against 16 or 32 activation rows at a time.
constexpr int64_t kGemmRows = 16;
constexpr int kGemmColsMax = 12;  // the most weight rows per GEMM call (Kernels::gemm_cols), and per dequantized block

// Packed activations of one expert, `ld` >= rows (a multiple of 16), zero past the rows:
//   fp32: packed[c * ld + m] = x[m][c]          bf16: packed[(c / 2) * 2 * ld + 2 * m + c % 2] = x[m][c]
// (bf16 in pairs of inputs, as vdpbf16ps multiplies them), round_up(k, 2) * ld values.
inline int64_t packed_index_f32(int64_t c, int64_t m, int64_t ld) { return c * ld + m; }
inline int64_t packed_index_bf16(int64_t c, int64_t m, int64_t ld) { return (c / 2) * 2 * ld + 2 * m + c % 2; }

struct Kernels {
  const char* isa;  // "avx512_bf16", "avx2" or "portable"
  int gemm_cols;    // weight rows per GEMM call (<= kGemmColsMax): a whole number of the set's register tiles
  // out[m * ldo + j] = sum_k x[m * ldx + k] * w[j * ldw + k], for m < rows, j < cols <= kTile.
  void (*dot_f32)(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t ldw, int cols, int64_t k,
                  float* out, int64_t ldo);
  void (*dot_bf16)(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t ldw, int cols,
                   int64_t k, float* out, int64_t ldo);
  // The dot product against int8 weight rows, dequantized in registers (q * scale in fp32, the values
  // dequant_f32 gives): out[m * ldo + j] = sum_c x[m * ldx + c] * q[j * ldq + c] * scale[j * ld_scale + c / group].
  void (*dot_q8)(const float* x, int64_t ldx, int64_t rows, const int8_t* q, int64_t ldq, const float* scale,
                 int64_t ld_scale, int64_t group, int cols, int64_t k, float* out, int64_t ldo);
  // dst[j * k + c] = q[j * ldq + c] * scale[j * ld_scale + c / group], for j < cols: int8 weight rows
  // dequantized to fp32, or to bf16 (rounded to nearest even, as torch's .to(torch.bfloat16)).
  void (*dequant_f32)(const int8_t* q, int64_t ldq, const float* scale, int64_t ld_scale, int64_t group, int cols,
                      int64_t k, float* dst);
  void (*dequant_bf16)(const int8_t* q, int64_t ldq, const float* scale, int64_t ld_scale, int64_t group, int cols,
                       int64_t k, uint16_t* dst);
  // dst[i] = bf16(src[i]), rounded to nearest even, for i < n.
  void (*to_bf16)(const float* src, int64_t n, uint16_t* dst);
  // out[m * ldo + j] = sum_c w[j * ldw + c] * x[m][c] for m < rows, j < cols, from packed activations (above).
  void (*gemm_f32)(const float* w, int64_t ldw, int cols, const float* packed, int64_t ld, int64_t rows, int64_t k,
                   float* out, int64_t ldo);
  void (*gemm_bf16)(const uint16_t* w, int64_t ldw, int cols, const uint16_t* packed, int64_t ld, int64_t rows,
                    int64_t k, float* out, int64_t ldo);
  // out[i] = act(g[i]) * u[i] * scale (u == nullptr: act(g[i]) * scale), for i < n.
  void (*activate)(const float* g, const float* u, float scale, int64_t n, Activation act, float* out);
};

// The best kernels for this CPU; `name` "portable" or "avx2" forces that set (tests, benchmarks), "auto" picks.
const Kernels& infer_kernels(const std::string& name = "auto");

// Whether `name` picks the AVX2 set where the AVX-512 one is not picked: "auto" or "avx2" on a CPU with AVX2 and FMA
// (the name "avx2" is an error on a CPU without them).
bool avx2_kernels(const std::string& name);

// The portable activations (Kernels::activate): the reference, and what the AVX2 and AVX-512 sets run for erf GELU.
void activate_portable(const float* g, const float* u, float scale, int64_t n, Activation act, float* out);

// Whether the kernel set `name` names is the AVX-512 one: "auto" on a CPU with AVX-512 BF16, or "avx512_bf16"
// (an error on a CPU without it); false for "portable" and "avx2"; an error for any other name.
bool avx512_kernels(const std::string& name);

// The table of a kernel set (Kernels here, AttentionKernels in decode_kernels.h) that `name` picks: `avx512` where
// avx512_kernels(name) says so, else `fallback` (the portable table, or the AVX2 one where `name` picks it).
// `avx512` is null in a build without the AVX-512 kernels, where avx512_kernels is never true.
template <class Table>
const Table& pick_kernels(const std::string& name, const Table& fallback, const Table* avx512) {
  return avx512_kernels(name) && avx512 != nullptr ? *avx512 : fallback;
}

}  // namespace infer
}  // namespace hf_moe
