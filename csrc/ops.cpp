// Shared helpers, and the Python module that loads the hf_moe CPU kernels.
// Kernels: cpu/*.cpp register the CPU implementations of the ops hf_moe/ops/library.py defines.

#include <Python.h>
#include <c10/util/Exception.h>

#include "activation.h"

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
// loads without this extension. cpu/*.cpp register the CPU kernels (TORCH_LIBRARY_IMPL) when the library loads.
//
// So the module itself has nothing in it: importing it loads the library. It is a plain CPython module rather than
// pybind11's, whose headers (through <torch/extension.h>, all of torch's Python API) made this the build's longest
// compile.
#define HF_MOE_STRING(x) HF_MOE_STRING_(x)
#define HF_MOE_STRING_(x) #x
#define HF_MOE_PYINIT(name) HF_MOE_PYINIT_(name)
#define HF_MOE_PYINIT_(name) PyInit_##name

static PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, HF_MOE_STRING(TORCH_EXTENSION_NAME),
    "hf_moe's compiled CPU kernels; importing this module registers them (the ops live in torch.ops.hf_moe)", -1,
    nullptr};

PyMODINIT_FUNC HF_MOE_PYINIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
