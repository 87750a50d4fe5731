"""Weight-only int8 quantization of expert weights, in pure torch: the format, and the oracle of the int8 kernel.

A weight [..., out, K] (an expert's `gate_up_proj` [2I, H] or `down_proj` [H, I], or all experts at once) becomes

    q      int8 [..., out, K]             round(w / scale), in [-127, 127] (symmetric: no zero point)
    scale  fp32 [..., out]                per output channel: max |w| of the row / 127          (group_size None)
           fp32 [..., out, K / g]         per group of g consecutive inputs of the row           (group_size g)

and `dequantize_int8(q, scale)` = q * scale is the weight the kernels compute with: the compiled kernel
(csrc/cpu/infer_cpu.cpp) multiplies by exactly these values, dequantized in fp32 (or rounded to bf16 when the
activations are bf16), so "dequantize, then matmul" is its reference.
"""

from __future__ import annotations

import torch

QMAX = 127


def _check_group(k: int, group_size: int | None) -> None:
    if group_size is None:
        return
    if group_size <= 0 or group_size % 32 or k % group_size:
        raise ValueError(
            f"group_size={group_size} does not fit {k} inputs: it must be a positive multiple of 32 that divides "
            f"{k} (e.g. {next((g for g in (128, 64, 32) if k % g == 0), None)}), or None for one scale per output "
            "channel."
        )


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [..., out, K], scale fp32 [..., out] or [..., out, K / group_size]) of a weight [..., out, K].

    Symmetric absmax scaling: scale = max |w| / 127 over the channel (or group), q = round(w / scale). A channel of
    zeros gets scale 0 and q 0.
    """
    k = weight.shape[-1]
    _check_group(k, group_size)
    w = weight.detach().float()
    if group_size is not None:
        w = w.reshape(*w.shape[:-1], k // group_size, group_size)
    scale = w.abs().amax(-1) / QMAX
    q = torch.round(w / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(weight.shape), scale.contiguous()


def scale_limit(in_features: int) -> float:
    """The largest sound int8 scale of a row of `in_features` inputs: 127 * scale * in_features <= the fp32 maximum.

    A row's dequantized weights are at most 127 * scale each, and the kernels sum in_features of their products with
    the activations in fp32: past this limit, inputs of magnitude 1 already overflow to infinity. Scales quantized
    from finite weights are many orders of magnitude below it (max |w| / 127); one above it was edited, or quantized
    from weights that had diverged.
    """
    return torch.finfo(torch.float32).max / (QMAX * max(int(in_features), 1))


def bad_scales(scale: torch.Tensor, in_features: int) -> int:
    """How many values of `scale` (int8 scales of rows of `in_features` inputs) are NaN, infinite, negative or above
    `scale_limit(in_features)` (0 for a sound tensor)."""
    good = (scale >= 0) & (scale <= scale_limit(in_features))  # (NaN fails both)
    return int((~good).sum())


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale as `dtype` (computed in fp32, then cast): [..., out, K]."""
    if scale.dim() == q.dim():  # grouped
        groups = scale.shape[-1]
        w = q.float().reshape(*q.shape[:-1], groups, q.shape[-1] // groups) * scale.float().unsqueeze(-1)
        return w.reshape(q.shape).to(dtype)
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def compute_weights(dtype: torch.dtype, w1, w1_scale, b1, w2, w2_scale, b2) -> tuple:
    """(w1, b1, w2, b2) of an expert layer as `dtype`, the activations' dtype: int8 weights dequantized with their
    scales, the others cast (what `moe_experts_infer` computes with, and its pure-torch references)."""
    def weight(w, scale):
        return dequantize_int8(w, scale, dtype) if w.dtype == torch.int8 else w.to(dtype)

    return weight(w1, w1_scale), None if b1 is None else b1.to(dtype), weight(w2, w2_scale), (
        None if b2 is None else b2.to(dtype)
    )


def group_size_of(q: torch.Tensor, scale: torch.Tensor) -> int | None:
    """The group size a (q, scale) pair was quantized with (None: per output channel)."""
    return q.shape[-1] // scale.shape[-1] if scale.dim() == q.dim() else None
