"""The bf16 linear layers of a prompt's forward in hf_moe's own generate loop, on a CPU without AVX-512 BF16.

There, ATen multiplies bf16 matrices several times slower than fp32 ones (oneDNN's fast bf16 GEMM needs AVX-512), and
a bf16 model's prompt spent much of its forward in the attention's `nn.Linear`s: transformers' modules, which hf_moe
neither replaces nor wraps (docs/serving-cpu.md, "A wider GEMM tile, and the prompt's linear layers", has the
figures).
`linears_on_linear_infer` gives the loop (`generation.one_op_sample`) a torch function mode to enter around that one
forward. Inside it, each `F.linear` of bf16 CPU tensors that needs no gradient runs `hf_moe::linear_infer`
(csrc/cpu/decode_cpu.cpp): it multiplies the same bf16 values widened to fp32 in ATen's fp32 GEMM and rounds the
result to bf16 once, as a bf16 GEMM accumulates in fp32 and rounds its output; a call of a few rows (the LM head on
the last position) takes the decode step's dot kernels instead. The sums run in another order than in ATen's bf16
GEMM, so the prompt's logits can differ from the plain forward's by a few bf16 steps (one rounding per product, over
every layer). Every other call passes through unchanged.

A torch function mode is torch's public way to redirect calls within a scope: it changes nothing in torch or
transformers, acts only while the `with` block runs, and only on the thread that entered it (torch keeps its modes per
thread), so another thread's forward of the same model is untouched.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import infer
from .extension import load_extension


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class LinearInferMode(TorchFunctionMode):
    """Within it, `F.linear(x, weight, bias)` of bf16 CPU tensors without autograd runs `hf_moe::linear_infer`:
    x [..., K], weight [O, K], bias [O] or None -> [..., O], bf16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0] if args else kwargs["input"], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _takes(x, weight, bias):
                out = torch.ops.hf_moe.linear_infer(x.reshape(-1, x.shape[-1]), weight, None, bias)
                return out.view(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


def _takes(x, weight, bias) -> bool:
    """Whether `linear_infer` computes this call: bf16 CPU tensors or parameters (no other subclass, such as a
    DTensor), a 2-D weight, and no gradient to record."""
    tensors = [x, weight] + ([] if bias is None else [bias])
    return (all(type(t) in _PLAIN and t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)
            and weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1]
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def applies() -> bool:
    """Whether a prompt's bf16 linears move to `linear_infer` here: the compiled extension loaded, on a CPU whose
    inference kernels are the AVX2 ones (no AVX-512 BF16, so ATen's bf16 GEMM is the slow one)."""
    return load_extension()[0] is not None and infer.kernel_isa() == "avx2"


def linears_on_linear_infer() -> contextlib.AbstractContextManager:
    """The mode to enter around a prompt's forward: `LinearInferMode` where it `applies`, elsewhere a context that
    does nothing."""
    return LinearInferMode() if applies() else contextlib.nullcontext()
