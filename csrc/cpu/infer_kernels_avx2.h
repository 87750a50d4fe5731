// The AVX2 (with FMA) kernels of infer_kernels.h's `Kernels`: the dot products and GEMMs, the activations and the
// rounding to bf16, compiled in infer_kernels_avx2.cpp for that target function by function. `infer_kernels` puts
// them in the table it picks on a CPU with AVX2 and FMA but not AVX-512 BF16, beside the portable kernel for
// dequantizing to bf16, which such a CPU does not run (infer_cpu.cpp: int8 experts compute in fp32 in a prefill, and
// by dot products on fp32 inputs in a decode). Dequantizing to fp32 is here: the prefill dequantizes each weight
// block once per call.
#pragma once

#include <cstdint>

#include "../activation.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define HF_MOE_HAS_AVX2_KERNELS 1

namespace hf_moe {
namespace infer {

// Whether this CPU runs the AVX2 kernels (AVX2 and FMA).
bool cpu_has_avx2_fma();

void dot_f32_avx2(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t ldw, int cols, int64_t k,
                  float* out, int64_t ldo);
void dot_bf16_avx2(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t ldw, int cols, int64_t k,
                   float* out, int64_t ldo);
void dot_q8_avx2(const float* x, int64_t ldx, int64_t rows, const int8_t* q, int64_t ldq, const float* scale,
                 int64_t ld_scale, int64_t group, int cols, int64_t k, float* out, int64_t ldo);
void dequant_f32_avx2(const int8_t* q, int64_t ldq, const float* scale, int64_t ld_scale, int64_t group, int cols,
                      int64_t k, float* dst);
void gemm_f32_avx2(const float* w, int64_t ldw, int cols, const float* packed, int64_t ld, int64_t rows, int64_t k,
                   float* out, int64_t ldo);
void gemm_bf16_avx2(const uint16_t* w, int64_t ldw, int cols, const uint16_t* packed, int64_t ld, int64_t rows,
                    int64_t k, float* out, int64_t ldo);
void to_bf16_avx2(const float* src, int64_t n, uint16_t* dst);
void activate_avx2(const float* g, const float* u, float scale, int64_t n, Activation act, float* out);

}  // namespace infer
}  // namespace hf_moe
#endif
