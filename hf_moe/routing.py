"""Recording what the routers did during one forward pass of a model."""

from __future__ import annotations

import torch
from torch import nn

from .layers import SparseMoeBlock


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE blocks, in forward (layer) order."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


class RouterRecorder:
    """Context manager that records each MoE block's router output, layer by layer.

    Inside the context, every call of a block's router appends:
        router_logits [N, E] (fp32) and top_k_index [N, k].
    The hooks are removed on exit, so the recompute of gradient checkpointing records nothing twice.
    """

    def __init__(self, model: nn.Module):
        self.blocks = moe_blocks(model)
        self.router_logits: list[torch.Tensor] = []
        self.top_k_index: list[torch.Tensor] = []
        self._handles = []

    def _hook(self, module, args, output):
        router_logits, _, top_k_index = output
        self.router_logits.append(router_logits)
        self.top_k_index.append(top_k_index)

    def __enter__(self) -> RouterRecorder:
        self._handles = [block.gate.register_forward_hook(self._hook) for block in self.blocks]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False
