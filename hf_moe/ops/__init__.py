"""Dispatch ops, their implementations, and the expert computation built from them.

`experts_forward(experts, hidden_states, top_k_index, top_k_weights)` is the one entry point of the MoE block
(and of transformers' `ExpertsInterface` under the name "hf_moe"). It runs the whole-layer op, or `ExpertsFunction`
(experts.py) composing the ops, of one of three implementations:

  * compiled: the C++ CPU kernels of csrc/ (OpenMP) for the `torch.ops.hf_moe.*` ops, built on first use;
  * torch:    `reference.py`, always available, the oracle the others are tested against, and the default on CUDA
              but for bf16 on sm90 (torch ops, with `torch.nn.functional.grouped_mm` for the GEMMs where it is torch's
              fast path);
  * triton:   `torch.ops.hf_moe_triton.*` from triton/ (GPU; CPU tensors under TRITON_INTERPRET=1): the CUDA
              default for bf16 experts on sm90, where `python -m hf_moe.gpu_check` passed on an H100; elsewhere
              opt-in with HF_MOE_BACKEND=triton.

Which one runs is decided in backend.py (`HF_MOE_BACKEND`, `use_backend`, `backend_report`); `python -m hf_moe.env`
says which and why. library.py defines every hf_moe op when this package is imported, so a saved `torch.export`
program that calls them loads in any process that has imported hf_moe. This module only re-exports.
"""

from __future__ import annotations

from . import library, reference
from .activations import activation_key
from .backend import (
    _KERNEL_NAMES,
    BACKENDS,
    REFERENCE,
    _compiled,
    autocast_cast,
    backend_report,
    cuda_default,
    dispatch_ops,
    expert_weights,
    experts_forward,
    kernel_activation,
    use_backend,
)
from .experts import DispatchOps, ExpertsFunction, run_experts
from .extension import backend_setting, load_extension
from .warmup import warmup

__all__ = [
    "BACKENDS", "DispatchOps", "ExpertsFunction", "REFERENCE", "activation_key", "autocast_cast", "backend_report",
    "backend_setting", "cuda_default", "dispatch_ops", "expert_weights", "experts_forward", "kernel_activation",
    "library", "load_extension", "reference", "run_experts", "use_backend", "warmup",
]
