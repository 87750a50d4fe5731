"""`QuantizedLinear`: an `nn.Linear` with weight-only int8 weights (made by `hf_moe.quantize_experts(...,
linears=True)` for the attention projections, dense MLPs, shared experts and the LM head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import backend_setting, load_extension
from ..ops.int8 import dequantize_int8, quantize_int8


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W stored as int8 and fp32 scales, in place of an `nn.Linear` (same `in_features`,
    `out_features`, `bias`).

    Buffers (O outputs, K inputs; scales per output row, or per group of `group_size` inputs):
        weight        int8 [O, K]       round(W / scale), in [-127, 127]
        weight_scale  fp32 [O] or [O, K / g]
        bias          [O] in the model's dtype (not quantized), or None
    The names are compressed-tensors' and FBGEMM's (`weight`, `weight_scale`). Buffers, not parameters: frozen, as
    int8 experts are, while gradients flow through to the input.

    Forward: [..., K] -> [..., O] in the input's dtype. On CPU with the compiled extension and no gradient needed,
    `hf_moe::linear_infer` (csrc/cpu/decode_cpu.cpp: a decode's few rows dequantized in registers, every weight row
    read once; more rows through ATen's GEMM on the dequantized weight); elsewhere the weight is dequantized to the
    input's dtype, then multiplied (the kernel's reference: the same numbers).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group_size: int | None = None,
                 bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        scale_shape = (out_features,) if group_size is None else (out_features, in_features // group_size)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.zeros(scale_shape, dtype=torch.float32))
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype) if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group_size: int | None = None) -> QuantizedLinear:
        """Quantize an `nn.Linear`: each output row (or group of inputs) scaled by its max |w| / 127."""
        weight = linear.weight
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size,
                     bias_dtype=weight.dtype)
        q, scale = quantize_int8(weight, group_size)
        module.weight.copy_(q)
        module.weight_scale.copy_(scale)
        if linear.bias is not None:
            module.bias.copy_(linear.bias)
        return module.to(weight.device)

    def _apply(self, fn, recurse=True):
        """`model.to(dtype)` casts floating tensors: the fp32 scales take the device `fn` gives, never its dtype."""
        scale = self.weight_scale
        super()._apply(fn, recurse)
        if self.weight_scale.dtype != torch.float32:
            self._buffers["weight_scale"] = scale.to(self.weight_scale.device)
        return self

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as q * scale in `dtype`: [O, K]."""
        return dequantize_int8(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if _kernel_runs(x):
            out = torch.ops.hf_moe.linear_infer(x.reshape(-1, self.in_features), self.weight, self.weight_scale, bias)
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        scales = "per channel" if self.group_size is None else f"groups of {self.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int8 weights, fp32 scales {scales}")


def _kernel_runs(x: torch.Tensor) -> bool:
    """`hf_moe::linear_infer` computes this call: CPU, fp32 or bf16, no gradient, and the compiled extension."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and not (torch.is_grad_enabled() and x.requires_grad)
            and backend_setting() != "torch" and _extension_loaded())


@torch.compiler.assume_constant_result  # decided on the host once; a trace keeps the answer
def _extension_loaded() -> bool:
    return load_extension()[0] is not None


def linear_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(weight [O, K], int8 scales or None, bias or None) of an `nn.Linear` or `QuantizedLinear`."""
    return module.weight, getattr(module, "weight_scale", None), module.bias
