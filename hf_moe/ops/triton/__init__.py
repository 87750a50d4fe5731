"""Triton kernels of the dispatch ops: the CUDA default for bf16 experts on sm90, opt-in elsewhere on CUDA
(HF_MOE_BACKEND=triton), executed on CPU by Triton's interpreter in the tests.

    routing.py       sort_by_expert: per-expert counts and the stable permutation, on the device (3 kernels)
    permute.py       permute (gather into expert order) and unpermute (weighted combine)
    activation.py    expert_act and its backward, with the routing weight folded in
    grouped_gemm.py  grouped GEMM forward / dX and dW over contiguous row groups, with the permute done inside;
                     torch's grouped_mm where it is the fast path
    configs.py       the GEMMs' autotune configs per dtype, fitted to the device's shared memory
    ops.py           the `torch.ops.hf_moe_triton.*` custom ops, their fake kernels, and the whole-layer expert
                     computation (defined without importing triton; a kernel that fails to compile falls back to torch)
    runtime.py       where the kernels can run, the launch counts, dtype-dependent constants
    aot.py           compiles every kernel for sm90 without a GPU (PTX and cubin) and reads its registers, stack
                     (spills) and shared memory, for the tests and the notes

Importing this package, or ops.py, does not import triton; `status` and running an op do.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from ...compat import triton_interpreter_problem
from ..experts import DispatchOps

MIN_CAPABILITY = (8, 0)  # bf16 tensor cores (tl.dot on bf16)


def version() -> str | None:
    """The installed triton's version, or None (found without importing it)."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def status(device_type: str) -> tuple[bool, str]:
    """Whether the Triton kernels can run on `device_type` tensors in this process, and why (not)."""
    found = version()
    if found is None:
        return False, "triton is not installed (pip install triton; the CPU wheel of torch does not pull it)"
    import triton

    interpreting = bool(triton.knobs.runtime.interpret)
    if device_type == "cpu":
        if interpreting:
            problem = triton_interpreter_problem()
            if problem is not None:
                return False, problem
            return True, "TRITON_INTERPRET=1: Triton's interpreter runs them on the host (slow; for tests)"
        return False, "CPU tensors need Triton's interpreter: TRITON_INTERPRET=1 before Python starts (for tests)"
    if device_type != "cuda":
        return False, f"Triton kernels run on CUDA, not {device_type}"
    if interpreting:
        return False, "TRITON_INTERPRET=1 is set, which interprets the kernels on the host; unset it on a GPU"
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return False, f"the GPU is sm{capability[0]}{capability[1]}; the kernels need sm80 or newer (bf16 tl.dot)"
    return True, f"triton {found} on sm{capability[0]}{capability[1]}"


def dispatch_ops(activation: str) -> DispatchOps:
    """The Triton implementation of every op, and the whole-layer expert computation, for a kernel activation name
    (others run their activation in torch)."""
    from .ops import ACTIVATIONS, whole_experts

    whole = whole_experts(activation)
    t = torch.ops.hf_moe_triton
    name = "triton" if activation in ACTIVATIONS else "triton, activation in torch"
    return DispatchOps(
        name, t.sort_by_expert, t.permute, t.unpermute, t.grouped_mm, t.grouped_mm_weight_grad, whole.expert_act,
        whole.expert_act_backward, t.moe_experts_forward, t.moe_experts_backward,
    )
