"""Building an MoE block from pieces of a dense MLP, whatever the conversion method."""

from __future__ import annotations

import torch
from torch import nn

from ..dense_mlp import DenseMLP
from ..layers import SparseMoeBlock


def neurons(mlp: DenseMLP, index: torch.Tensor) -> DenseMLP:
    """The part of `mlp` made of the intermediate neurons `index` [n]: rows of gate/up, columns of down.

    The down bias is left out: it belongs to the whole MLP, and `assemble_block` places it where it is added once.
    """
    pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
    return DenseMLP(
        up=pick(mlp.up), down=mlp.down.index_select(1, index), gate=pick(mlp.gate), up_bias=pick(mlp.up_bias),
        gate_bias=pick(mlp.gate_bias), down_bias=None, act=mlp.act, dropout=mlp.dropout,
    )


def _bias(bias: torch.Tensor | None, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The bias, or zeros when this projection has none (a zero bias changes nothing)."""
    return bias if bias is not None else like.new_zeros(rows)


def assemble_block(
    config,
    experts: list[DenseMLP],
    router_weight: torch.Tensor,
    shared: DenseMLP | None = None,
    down_bias: torch.Tensor | None = None,
    share_identical: bool = False,
) -> SparseMoeBlock:
    """An MoE block holding `experts` (E pieces of equal size), `shared` (always active) and the router weight
    [E, H], on the device and dtype of the pieces.

    `down_bias` [H], the dense MLP's output bias, goes where it is added exactly once per token: into the shared
    experts if any, else into every routed expert when their weights sum to one (upcycling), else into the block's
    output bias (`moe_output_bias`).

    With `share_identical=True`, experts made of the very same tensors share one copy: the stacked parameter is an
    expanded view [E, ...] of it. Such a block computes like any other but is for reading out (the streaming
    conversion writes it to disk), not for training.
    """
    first = experts[0]
    device, dtype = first.up.device, first.up.dtype
    with torch.device("meta"):
        block = SparseMoeBlock(config)

    def stack(pieces: list[list[torch.Tensor]]) -> nn.Parameter:
        """[E, ...]: expert e's pieces concatenated along dim 0, written in place (no per-expert temporaries:
        an upcycled block may hold E copies of a large MLP)."""
        head = pieces[0]
        if share_identical and all(all(a is b for a, b in zip(parts, head)) for parts in pieces):
            row = torch.cat(head) if len(head) > 1 else head[0]
            return nn.Parameter(row.unsqueeze(0).expand(len(pieces), *row.shape), requires_grad=False)
        out = torch.empty(
            (len(pieces), sum(p.shape[0] for p in head), *head[0].shape[1:]), dtype=head[0].dtype, device=device
        )
        for row, parts in zip(out, pieces):
            torch.cat(parts, out=row)
        return nn.Parameter(out)

    e = block.experts
    if config.expert_glu:
        e.gate_up_proj = stack([[m.gate, m.up] for m in experts])
    else:
        e.up_proj = stack([[m.up] for m in experts])
    e.down_proj = stack([[m.down] for m in experts])
    if config.expert_bias:
        rows = first.up.shape[0]
        if config.expert_glu:
            e.gate_up_proj_bias = stack(
                [[_bias(m.gate_bias, rows, m.up), _bias(m.up_bias, rows, m.up)] for m in experts]
            )
        else:
            e.up_proj_bias = stack([[_bias(m.up_bias, rows, m.up)] for m in experts])
        routed_bias = down_bias if shared is None and not config.moe_output_bias else None
        e.down_proj_bias = stack([[_bias(routed_bias, m.down.shape[0], m.down)] for m in experts])

    if shared is not None:
        with torch.device(device):
            block.shared_experts = type(block.shared_experts)(config).to(dtype)
        s = block.shared_experts
        with torch.no_grad():
            s.up_proj.weight.copy_(shared.up)
            s.down_proj.weight.copy_(shared.down)
            if config.expert_glu:
                s.gate_proj.weight.copy_(shared.gate)
            if config.expert_bias:
                rows = shared.up.shape[0]
                s.up_proj.bias.copy_(_bias(shared.up_bias, rows, shared.up))
                s.down_proj.bias.copy_(_bias(down_bias, shared.down.shape[0], shared.down))
                if config.expert_glu:
                    s.gate_proj.bias.copy_(_bias(shared.gate_bias, rows, shared.up))
    if config.moe_output_bias:
        block.bias = nn.Parameter(_bias(down_bias, first.down.shape[0], first.down).clone())

    with torch.device(device):  # the block's router again, its extra parameters and buffers on the real device
        block.gate = type(block.gate)(config).to(dtype)
    with torch.no_grad():
        block.gate.weight.copy_(router_weight)
    return block
