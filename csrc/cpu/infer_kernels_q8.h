// The AVX-512 int8 kernels of infer_kernels.h's `Kernels` (dot_q8, dequant_f32, dequant_bf16), compiled in
// infer_kernels_q8.cpp. Only `infer_kernels` calls them, on a CPU with AVX-512 BF16.
#pragma once

#include <cstdint>

#include "simd_avx512.h"

#ifdef HF_MOE_HAS_AVX512_KERNELS
namespace hf_moe {
namespace infer {

HF_AVX512 void dot_q8_avx512(const float* x, int64_t ldx, int64_t rows, const int8_t* q, int64_t ldq,
                             const float* scale, int64_t ld_scale, int64_t group, int cols, int64_t k, float* out,
                             int64_t ldo);
HF_AVX512 void dequant_f32_avx512(const int8_t* q, int64_t ldq, const float* scale, int64_t ld_scale, int64_t group,
                                  int cols, int64_t k, float* dst);
HF_AVX512 void dequant_bf16_avx512(const int8_t* q, int64_t ldq, const float* scale, int64_t ld_scale, int64_t group,
                                   int cols, int64_t k, uint16_t* dst);

}  // namespace infer
}  // namespace hf_moe
#endif
