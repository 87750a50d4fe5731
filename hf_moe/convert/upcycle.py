"""Sparse upcycling (Komatsuzaki et al., 2022): every expert starts as a copy of the dense MLP.

Drop-Upcycling (Nakamura et al., 2025) re-initialises a fraction of each copy's intermediate neurons, a different
subset per expert, so the experts start diverse: their gate/up rows and down columns are drawn from a normal with
the mean and std of the dense weight they replace, and their biases are zeroed.
"""

from __future__ import annotations

import torch

from ..dense_mlp import DenseMLP
from ..layers import SparseMoeBlock
from .assemble import assemble_block, neurons


def upcycle_block(
    mlp: DenseMLP,
    config,
    *,
    noise: float = 0.0,
    reinit_fraction: float = 0.0,
    generator: torch.Generator | None = None,
    share_identical: bool = False,
) -> SparseMoeBlock:
    """An MoE block whose E experts are copies of `mlp`, on `mlp`'s device and dtype.

    With `num_shared_experts` S > 0, the dense MLP's intermediate neurons are cut into S + 1 equal slices: the
    first S make the shared experts and every routed expert copies the last one, so shared + routed = dense.

    Args:
        noise: std of Gaussian noise added to each routed copy, relative to the std of the weight it perturbs
            (0 keeps the copies identical). Biases get no noise.
        reinit_fraction: Drop-Upcycling: the fraction of each routed copy's neurons re-initialised (0 keeps them).
        generator: CPU generator for the router init, the noise and the re-initialised neurons.
        share_identical: True lets identical copies share memory (see `assemble_block`): for writing out only.
    Returns:
        A `SparseMoeBlock`; the router is drawn from N(0, config.moe_init_std).

    With renormalised top-k weights, no noise and no re-initialisation the block computes
    shared(x) + sum_j w_j * routed(x) = MLP(x): the converted model reproduces the dense one up to fp32 rounding.
    """
    s = config.num_shared_experts
    shared = None
    routed = mlp
    if s:
        slice_size = mlp.intermediate_size // (s + 1)
        order = torch.arange(mlp.intermediate_size, device=mlp.up.device)
        shared = neurons(mlp, order[: s * slice_size])
        routed = neurons(mlp, order[s * slice_size :])
    experts = []
    for _ in range(config.num_experts):
        if noise == 0 and reinit_fraction == 0:
            experts.append(routed)  # identical copies: `assemble_block` writes each into the stacked tensor
            continue
        copy = neurons(routed, torch.arange(routed.intermediate_size, device=mlp.up.device))
        if noise > 0:
            for name in ("up", "down", "gate"):
                weight = getattr(copy, name)
                if weight is not None:
                    scale = noise * weight.float().std().item()
                    setattr(copy, name, weight + (torch.randn(weight.shape, generator=generator) * scale).to(weight))
        if reinit_fraction > 0:
            _reinit_neurons(copy, round(reinit_fraction * copy.intermediate_size), generator)
        experts.append(copy)
    router = torch.randn(config.num_experts, mlp.hidden_size, generator=generator) * config.moe_init_std
    return assemble_block(config, experts, router, shared=shared, down_bias=mlp.down_bias,
                          share_identical=share_identical)


def _reinit_neurons(mlp: DenseMLP, count: int, generator: torch.Generator | None) -> None:
    """Redraw `count` random intermediate neurons of `mlp` in place (its tensors are its own copies)."""
    if count == 0:
        return
    index = torch.randperm(mlp.intermediate_size, generator=generator)[:count].to(mlp.up.device)
    with torch.no_grad():
        for name, dim in (("gate", 0), ("up", 0), ("down", 1)):
            weight = getattr(mlp, name)
            if weight is None:
                continue
            stats = weight.float()
            shape = list(weight.shape)
            shape[dim] = count
            fresh = torch.randn(shape, generator=generator) * stats.std().item() + stats.mean().item()
            weight.index_copy_(dim, index, fresh.to(weight))
        for name in ("gate_bias", "up_bias"):
            bias = getattr(mlp, name)
            if bias is not None:
                bias.index_fill_(0, index, 0)
