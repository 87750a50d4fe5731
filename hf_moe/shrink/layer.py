"""One MoE layer under the knife: its routing, every expert's output on the calibration tokens, and the smaller
block and routers built from chosen rows.

Routers and blocks are always the model's own classes (hf_moe's `SparseMoeBlock` and registered routers, or the
native family's `...SparseMoeBlock` / `...TopKRouter`) built from a config with fewer experts: what a candidate
subset computes is what the saved checkpoint will compute, for every family, without re-implementing its routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from torch import nn

from ..layers import RouterOutput, SparseMoeBlock, build_router

EXPERTS, GATE = "experts.", "gate."


@dataclass
class LayerData:
    """What one MoE layer does on N calibration tokens (E experts, H hidden, k per token).

    x [N, H] fp32: the block's input; logits [N, E] fp32: the router's logits; index [N, k] (-1: not computed) and
    weights [N, k] fp32: its routing; outputs [E, N, H] fp32: every expert's output on every token (None when the
    method needs none); routed [N, H]: the block's output without shared experts (the reconstruction target).
    """

    x: torch.Tensor
    logits: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    outputs: torch.Tensor | None = None
    routed: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.logits.shape[1]

    def usage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([E] pairs routed to each expert, [E] routing weight they carry), fp64."""
        counts = torch.zeros(self.num_experts, dtype=torch.float64)
        mass = torch.zeros(self.num_experts, dtype=torch.float64)
        valid = self.index >= 0
        ids = self.index.clamp_min(0)[valid]
        counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float64))
        mass.index_add_(0, ids, self.weights[valid].double())
        return counts, mass


def route(gate: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index [N, k], weights [N, k] fp32, logits [N, E] fp32) of a router: hf_moe's (a `RouterOutput`) or a native
    family's ((logits, weights, index))."""
    out = gate(x)
    if isinstance(out, RouterOutput):
        return out.dispatch_index(), out.top_k_weights.float(), out.router_logits.float()
    logits, weights, index = out
    return index, weights.float(), logits.float()


def combine(outputs: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[n, j] * outputs[index[n, j], n] -> [N, H]; slots with index -1 add nothing.
    outputs [E, N, H], index / weights [N, k]."""
    e, n, h = outputs.shape
    rows = index.clamp_min(0) * n + torch.arange(n).unsqueeze(1)  # [N, k] rows of outputs.view(E * N, H)
    picked = outputs.reshape(e * n, h).index_select(0, rows.reshape(-1)).view(n, -1, h)
    w = torch.where(index >= 0, weights, 0.0).to(outputs.dtype)
    return torch.bmm(w.unsqueeze(1), picked).squeeze(1)


def expert_params(block: nn.Module, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """{name: fused tensor [E, ...] fp32} of the block's experts."""
    return {name: getattr(block.experts, name).detach().float() for name in names}


def expert_outputs(experts: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """[E, N, H]: each expert of `params` ({name: [E, ...]}, the layout of `experts`, whose activation and kind it
    uses) on every row of x [N, H], fp32."""
    glu = getattr(experts, "has_gate", True)
    up = params["gate_up_proj" if glu else "up_proj"]
    up_bias = params.get("gate_up_proj_bias" if glu else "up_proj_bias")
    down, down_bias = params["down_proj"], params.get("down_proj_bias")
    out = x.new_empty(up.shape[0], x.shape[0], down.shape[1])
    for e in range(up.shape[0]):
        h = x @ up[e].t()
        if up_bias is not None:
            h = h + up_bias[e]
        if glu:
            gate, lin = h.chunk(2, dim=-1)
            h = experts.act_fn(gate) * lin
        else:
            h = experts.act_fn(h)
        y = h @ down[e].t()
        out[e] = y + down_bias[e] if down_bias is not None else y
    return out


def _router_class_of(block: nn.Module):
    """A function config -> a new router of the block's kind."""
    if isinstance(block, SparseMoeBlock):
        return build_router
    return type(block.gate)


def make_router(block: nn.Module, config, state: dict[str, torch.Tensor]) -> nn.Module:
    """A router of `block`'s kind for `config` (fewer experts), holding `state` (its rows), in eval mode."""
    with init_empty_weights(include_buffers=False):
        router = _router_class_of(block)(config)
    router.load_state_dict(state, strict=True, assign=True)
    return router.eval()


def make_block(block: nn.Module, config, state: dict[str, torch.Tensor]) -> nn.Module:
    """A block of `block`'s class for `config` (fewer experts), holding `state`, in eval mode."""
    with init_empty_weights(include_buffers=False):
        new = SparseMoeBlock(config) if isinstance(block, SparseMoeBlock) else type(block)(config)
    new.load_state_dict(state, strict=True, assign=True)
    return new.eval()


def replaced_block(block: nn.Module, config, router: dict[str, torch.Tensor],
                   experts: dict[str, torch.Tensor]) -> nn.Module:
    """A block of `block`'s class for `config` (fewer experts) with router state `router` and fused expert tensors
    `experts` ({name: [m, ...]}), everything else (a shared expert) `block`'s own, each cast to `block`'s dtype."""
    own = block.state_dict()
    state = {k: v for k, v in own.items() if not k.startswith((GATE, EXPERTS))}
    state.update({GATE + k: v for k, v in router.items()})
    state.update({EXPERTS + k: v for k, v in experts.items()})
    return make_block(block, config, {k: v.to(own[k].dtype) for k, v in state.items()})


def router_state(block: nn.Module) -> dict[str, torch.Tensor]:
    """The router's state (weight [E, H], and an aux_free bias or noisy_topk noise weight where it has one), fp32."""
    return {k: v.detach().float() for k, v in block.gate.state_dict().items()}


def select_rows(state: dict[str, torch.Tensor], rows: list[int], num_experts: int) -> dict[str, torch.Tensor]:
    """`state` with its per-expert tensors (first dim E) cut to `rows`, in that order."""
    index = torch.tensor(rows, dtype=torch.long)
    return {k: v.index_select(0, index) if v.dim() and v.shape[0] == num_experts else v for k, v in state.items()}


def is_sigmoid_router(block: nn.Module) -> bool:
    """Whether the router scores experts by sigmoid (hf_moe's aux_free) rather than a softmax over them."""
    return hasattr(block.gate, "e_score_correction_bias") and isinstance(block, SparseMoeBlock)
