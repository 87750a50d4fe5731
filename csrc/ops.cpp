// Schemas of the hf_moe ops (torch.library), shared helpers, and the Python module (pybind11).
// Kernels: cpu/*.cpp register the CPU implementations. CUDA tensors run the Triton kernels (hf_moe/ops/triton/).

#include <torch/extension.h>
#include <torch/library.h>

#include "hf_moe.h"

namespace hf_moe {

Activation parse_activation(const std::string& name) {
  if (name == "silu") return Activation::Silu;
  if (name == "gelu") return Activation::Gelu;
  if (name == "gelu_tanh") return Activation::GeluTanh;
  if (name == "relu") return Activation::Relu;
  if (name == "relu2") return Activation::Relu2;
  TORCH_CHECK(false, "hf_moe: no compiled kernel for activation '", name,
              "' (supported: silu, gelu, gelu_tanh, relu, relu2)");
}

// Ahead-of-time builds (setup.py) are stamped with the hash of their sources, which the loader reads from the
// file before importing it, so a stale hf_moe._C is never loaded (hf_moe/ops/extension.py).
#ifdef HF_MOE_SOURCE_HASH
__attribute__((used)) const char kSourceStamp[] = "hf_moe_source_hash=" HF_MOE_SOURCE_HASH;
#endif

}  // namespace hf_moe

TORCH_LIBRARY(hf_moe, m) {
  m.def("sort_by_expert(Tensor top_k_index, int num_experts) -> (Tensor, Tensor, Tensor)");
  m.def("permute(Tensor hidden_states, Tensor sorted_slots, int top_k) -> Tensor");
  m.def("unpermute(Tensor rows, Tensor slot_to_row, Tensor? top_k_weights, int top_k) -> Tensor");
  m.def(
      "grouped_mm(Tensor x, Tensor weight, Tensor tokens_per_expert, Tensor? bias, Tensor? bias_scale, "
      "bool transpose_weight) -> Tensor");
  m.def("grouped_mm_weight_grad(Tensor grad_out, Tensor x, Tensor tokens_per_expert) -> Tensor");
  m.def("expert_act(Tensor h, Tensor? row_scale, str activation, bool glu) -> Tensor");
  m.def(
      "expert_act_backward(Tensor grad, Tensor h, Tensor? row_scale, str activation, bool glu, "
      "bool return_output) -> (Tensor, Tensor, Tensor)");
  // The whole expert computation in one call (CPU): (out, h, sorted_slots, slot_to_row, tokens_per_expert,
  // row_weight). h is empty unless save_h.
  m.def(
      "moe_experts_forward(Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, Tensor w1, Tensor? b1, "
      "Tensor w2, Tensor? b2, str activation, bool glu, bool save_h) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // (grad_x, grad_top_k_weights, grad_w1, grad_b1, grad_w2, grad_b2); empty where not asked for or no bias.
  m.def(
      "moe_experts_backward(Tensor grad_out, Tensor hidden_states, Tensor h, Tensor sorted_slots, "
      "Tensor slot_to_row, Tensor tokens_per_expert, Tensor row_weight, Tensor w1, Tensor? b1, Tensor w2, "
      "Tensor? b2, str activation, bool glu, bool need_x, bool need_weights, bool need_params) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "hf_moe compiled dispatch and expert kernels (ops live in torch.ops.hf_moe)";
  module.def("build_info", [] {
    pybind11::dict info;
#ifdef _OPENMP
    info["openmp"] = true;
#else
    info["openmp"] = false;
#endif
    info["parallel"] = at::get_parallel_info();
    return info;
  });
}
