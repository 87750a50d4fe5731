// The activations the C++ kernels implement, with no torch headers: the pure-SIMD kernel files (cpu/infer_kernels*.cpp,
// cpu/decode_kernels.cpp) need only this, and parsing ATen would be most of their compile time.
#pragma once

#include <string>

namespace hf_moe {

// Others run through the pure-torch activation.
enum class Activation { Silu, Gelu, GeluTanh, Relu, Relu2 };
Activation parse_activation(const std::string& name);

}  // namespace hf_moe
