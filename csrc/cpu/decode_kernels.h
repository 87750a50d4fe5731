// Inner kernels of one token's attention over a KV cache (decode_cpu.cpp), one set per instruction set like
// infer_kernels.h: AVX-512 where the CPU has it (with BF16), else AVX2 where it has that (with FMA), else portable C++;
// picked at run time.
#pragma once

#include <cstdint>
#include <string>

namespace hf_moe {
namespace infer {

struct AttentionKernels {
  const char* isa;  // "avx512_bf16", "avx2" or "portable"
  // x[i] = exp(x[i] - shift) for i < n, 0 where x[i] is -inf (a masked position); returns the sum of the results.
  float (*exp_sum)(float* x, int64_t n, float shift);
  // acc[c] += sum over j < n of p[j] * v[j * ldv + c], for c < d: fp32 rows of v, or bf16 rows (as their bits).
  void (*accumulate_f32)(const float* p, int64_t n, const float* v, int64_t ldv, int64_t d, float* acc);
  void (*accumulate_bf16)(const float* p, int64_t n, const uint16_t* v, int64_t ldv, int64_t d, float* acc);
};

// The best kernels for this CPU; "portable" or "avx2" forces that set (tests), "auto" picks.
const AttentionKernels& attention_kernels(const std::string& name = "auto");

}  // namespace infer
}  // namespace hf_moe
