"""Sparse upcycling (Komatsuzaki et al., 2022): every expert starts as a copy of the dense MLP."""

from __future__ import annotations

import torch
from torch import nn

from ..layers import SparseMoeBlock, build_router
from .adapters import DenseMLP


def upcycle_block(
    mlp: DenseMLP, config, *, noise: float = 0.0, generator: torch.Generator | None = None
) -> SparseMoeBlock:
    """An MoE block whose E experts are copies of `mlp`, on `mlp`'s device and dtype.

    Args:
        noise: std of Gaussian noise added to each copy, relative to the std of the weight it perturbs
            (0 keeps the copies identical). Biases get no noise.
        generator: CPU generator for the router init and the noise, for reproducible conversions.
    Returns:
        A `SparseMoeBlock`; the router is drawn from N(0, config.moe_init_std).

    With `norm_topk_prob` (renormalised top-k weights) and no noise, the block computes
    sum_j w_j * MLP(x) = MLP(x): the converted model reproduces the dense one up to fp32 rounding.
    """
    device, dtype = mlp.up.device, mlp.up.dtype
    e = config.num_experts
    with torch.device("meta"):
        block = SparseMoeBlock(config)

    def copies(weight: torch.Tensor, perturb: bool) -> nn.Parameter:
        stacked = weight.unsqueeze(0).expand(e, *weight.shape).clone(memory_format=torch.contiguous_format)
        if perturb and noise > 0:
            scale = noise * weight.float().std().item()
            stacked += (torch.randn(stacked.shape, generator=generator) * scale).to(device=device, dtype=dtype)
        return nn.Parameter(stacked)

    experts = block.experts
    if mlp.glu:
        experts.gate_up_proj = copies(torch.cat([mlp.gate, mlp.up], dim=0), True)
        if config.expert_bias:
            experts.gate_up_proj_bias = copies(torch.cat([_bias(mlp.gate_bias, mlp.gate), _bias(mlp.up_bias, mlp.up)]), False)
    else:
        experts.up_proj = copies(mlp.up, True)
        if config.expert_bias:
            experts.up_proj_bias = copies(_bias(mlp.up_bias, mlp.up), False)
    experts.down_proj = copies(mlp.down, True)
    if config.expert_bias:
        experts.down_proj_bias = copies(_bias(mlp.down_bias, mlp.down), False)

    with torch.device(device):
        block.gate = build_router(config).to(dtype)  # its extra parameters and buffers, on the real device
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(e, mlp.hidden_size, generator=generator) * config.moe_init_std)
    return block


def _bias(bias: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """The bias, or zeros when this projection has none (a zero bias changes nothing)."""
    return bias if bias is not None else weight.new_zeros(weight.shape[0])
