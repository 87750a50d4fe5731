"""The MoE block: a drop-in replacement for a dense MLP."""

from __future__ import annotations

import torch
from torch import nn

from .experts import Experts
from .router import TopKRouter


class SparseMoeBlock(nn.Module):
    """Router + experts. `block(hidden_states)` has the shape of `mlp(hidden_states)`.

    Submodules are named as in transformers' MoE models: `gate` (the router) and `experts`.
    The router's output is not returned; the model collects it with a forward hook on `gate` when it needs it
    (aux loss, `output_router_logits`).

    Forward:
        hidden_states [..., H] -> [..., H]
    """

    def __init__(self, config):
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.dropout = nn.Dropout(config.moe_output_dropout) if config.moe_output_dropout else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])  # [N, H]
        _, top_k_weights, top_k_index = self.gate(flat)
        out = self.experts(flat, top_k_index, top_k_weights).view(shape)
        return self.dropout(out) if self.dropout is not None else out
