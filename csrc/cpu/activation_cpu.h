// Expert activations on CPU through ATen's vectorised kernels (they pick AVX2/AVX-512 at run time).
#pragma once

#include <ATen/ATen.h>

#include "../hf_moe.h"

namespace hf_moe {

// out = act(x)
inline void activation_out(at::Tensor& out, const at::Tensor& x, Activation act) {
  switch (act) {
    case Activation::Silu: at::silu_out(out, x); break;
    case Activation::Gelu: at::gelu_out(out, x, "none"); break;
    case Activation::GeluTanh: at::gelu_out(out, x, "tanh"); break;
    case Activation::Relu: at::clamp_min_out(out, x, 0); break;
    case Activation::Relu2: at::clamp_min_out(out, x, 0).square_(); break;
  }
}

// out = act'(x) * grad
inline void activation_backward_out(at::Tensor& out, const at::Tensor& grad, const at::Tensor& x, Activation act) {
  switch (act) {
    case Activation::Silu: at::silu_backward_out(out, grad, x); break;
    case Activation::Gelu: at::gelu_backward_out(out, grad, x, "none"); break;
    case Activation::GeluTanh: at::gelu_backward_out(out, grad, x, "tanh"); break;
    case Activation::Relu: at::threshold_backward_out(out, grad, x, 0); break;
    case Activation::Relu2: at::mul_out(out, grad, x.clamp_min(0).mul_(2)); break;
  }
}

}  // namespace hf_moe
