// The decode step's activations as its C++ kernels read and write them (decode_cpu.cpp, the attention sub-block;
// decode_step_cpu.cpp, the plan's final norm): fp32 values of the model's dtype, rounded where the eager model rounds,
// and Llama's RMSNorm over them. Internal linkage (an anonymous namespace): each file that includes it has its own.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

namespace hf_moe {
namespace {

inline float bf16_round(float v) { return static_cast<float>(c10::BFloat16(v)); }

inline uint16_t bf16_bits(float v) { return c10::BFloat16(v).x; }

// The activations of the model, read and written as fp32 values: every value written is rounded to the dtype.
struct Values {
  bool bf16;
  float round(float v) const { return bf16 ? bf16_round(v) : v; }
  float load(const void* p, int64_t i) const {
    return bf16 ? static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  void store(void* p, int64_t i, float v) const {
    if (bf16) static_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(v);
    else static_cast<float*>(p)[i] = v;
  }
};

// RMSNorm as transformers' Llama computes it: y = w * dtype(x * rsqrt(mean(x^2) + eps)), each product rounded.
// x: n values (fp32, already of the dtype), w: the norm's weight (the model's dtype).
inline void rms_norm(const Values& val, const float* x, int64_t n, const void* w, float eps, float* y) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = val.round(val.load(w, i) * val.round(x[i] * r));
}

// rms_norm of row b of `in` [., h] (the model's dtype) into row b of `out`, through `row` (h floats of scratch).
inline void rms_norm_row(const Values& val, const void* in, int64_t b, int64_t h, const void* w, float eps, float* row,
                  void* out) {
  for (int64_t i = 0; i < h; ++i) row[i] = val.load(in, b * h + i);
  rms_norm(val, row, h, w, eps, row);
  for (int64_t i = 0; i < h; ++i) val.store(out, b * h + i, row[i]);
}

}  // namespace
}  // namespace hf_moe
