"""The MoE block: a drop-in replacement for a dense MLP."""

from __future__ import annotations

import torch
from torch import nn

from .experts import Experts
from .router import build_router


class SparseMoeBlock(nn.Module):
    """Router + experts. `block(hidden_states)` has the shape of `mlp(hidden_states)`.

    Submodules are named as in transformers' MoE models: `gate` (the router, see `router.py`) and `experts`.
    The router's decision is not returned; the model collects it with a forward hook on `gate` when it needs it
    (losses, statistics, `output_router_logits`).

    Forward:
        hidden_states [..., H] -> [..., H]
    """

    def __init__(self, config):
        super().__init__()
        self.gate = build_router(config)
        self.experts = Experts(config)
        self.dropout = nn.Dropout(config.moe_output_dropout) if config.moe_output_dropout else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])  # [N, H]
        routing = self.gate(flat)
        if routing.is_expert_choice:
            out = self.experts.expert_choice(flat, routing.expert_index, routing.expert_weights)
        else:
            out = self.experts(flat, routing.dispatch_index(), routing.top_k_weights)
        out = out.view(shape)
        return self.dropout(out) if self.dropout is not None else out
