"""Launching the Triton kernels: where they can run, the launch counts, and the dtype-dependent constants.

Triton decides when a kernel is *defined* (`@triton.jit`) whether it is compiled for the GPU or run by its
interpreter: `triton.knobs.runtime.interpret`, i.e. `TRITON_INTERPRET=1` in the environment at import time of
the kernel modules. `INTERPRETING` records that decision, so it can be checked against the tensors at launch:
  * GPU:          CUDA tensors, kernels compiled by Triton (backend.cuda_default says where);
  * interpreter:  CPU tensors, each program run by numpy (how the tests execute every kernel on CPU; slow).
"""

from __future__ import annotations

import collections

import torch
import triton
import triton.language as tl

INTERPRETING: bool = bool(triton.knobs.runtime.interpret)

# Launches per kernel (by function name) in this process: the tests print it to show every kernel ran.
launch_counts: collections.Counter[str] = collections.Counter()


def kernel_name(kernel) -> str:
    """The Python name of a (jitted, interpreted or autotuned) kernel."""
    while hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel.__name__


def launch(kernel, grid, device: torch.device, *args, **meta) -> None:
    """`kernel[grid](*args, **meta)` on `device`, counted in `launch_counts`."""
    launch_counts[kernel_name(kernel)] += 1
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def check_device(*tensors: torch.Tensor | None) -> torch.device:
    """The common device of the tensors, after checking the kernels can run there."""
    device = next(t.device for t in tensors if t is not None)
    for t in tensors:
        if t is not None and t.device != device:
            raise ValueError(f"hf_moe Triton ops: tensors on {t.device} and {device}; move them to one device.")
    if device.type == "cuda" and not INTERPRETING:
        return device
    if device.type == "cpu" and INTERPRETING:
        return device
    if device.type == "cpu":
        raise RuntimeError(
            "hf_moe Triton kernels got CPU tensors, but Triton's interpreter is off. Run with TRITON_INTERPRET=1 in "
            "the environment before Python starts (slow; for tests), or use HF_MOE_BACKEND=auto|compiled|torch on CPU."
        )
    raise RuntimeError(f"hf_moe Triton kernels run on CUDA tensors (or CPU ones under TRITON_INTERPRET=1), not on "
                       f"{device.type}.")


def accumulator(dtype: torch.dtype):
    """The Triton type sums are kept in: fp64 for fp64 inputs, fp32 otherwise."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def dot_precision(dtype: torch.dtype) -> str | None:
    """`tl.dot`'s input_precision. fp32 follows torch's matmul setting (TF32 only when torch allows it, as
    `torch.set_float32_matmul_precision("high")` does); fp64 is exact; 16-bit types have one precision."""
    if dtype == torch.float64:
        return "ieee"
    if dtype == torch.float32:
        return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return None


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether the GEMM kernels convert their tiles to fp32 before `tl.dot`.

    Only under the interpreter, for bf16: triton 3.9's interpreter multiplies bf16 tiles as their raw uint16 bits
    (`create_dot` converts fp8 but not bf16). On the GPU bf16 tiles go to the tensor cores as they are. Both
    compute the products exactly (bf16 x bf16 fits in fp32) and sum them in fp32, so the interpreter checks the
    same arithmetic.
    """
    return INTERPRETING and dtype == torch.bfloat16


# Under the interpreter, `cast` rounds fp32 -> bf16 by hand: triton 3.9's interpreter truncates that conversion
# (`InterpreterBuilder.cast_impl` passes no rounding mode), where the GPU, and torch, round to nearest even.
_ROUND_BY_HAND = tl.constexpr(INTERPRETING)


@triton.jit
def cast(x, dtype: tl.constexpr):
    """`x.to(dtype)` for a store, rounding to nearest even as the GPU does (also under the interpreter)."""
    if _ROUND_BY_HAND and dtype == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round the low 16 bits away, ties to even
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
