// Shared helpers and the Python module (pybind11) of the hf_moe CPU kernels.
// Kernels: cpu/*.cpp register the CPU implementations of the ops hf_moe/ops/library.py defines.

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

// The schemas of the hf_moe ops are defined in Python when hf_moe is imported (hf_moe/ops/library.py), with their
// shape functions, backward formulas and pure-torch default kernels, so a saved exported program that calls them
// loads without this extension. cpu/*.cpp register the CPU kernels (TORCH_LIBRARY_IMPL).

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
