"""Routers ("gates" in FastMoE): score each token against every expert and pick its top-k."""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init


class TopKRouter(nn.Module):
    """Softmax over experts, then top-k, with optionally renormalised weights (Mixtral, Qwen3-MoE).

    The logits and the softmax are computed in fp32 whatever the model's dtype, as in Switch Transformer.

    Parameters:
        weight: [E, H]
    Forward:
        hidden_states [N, H] -> (router_logits [N, E] fp32, top_k_weights [N, k] in the input dtype,
        top_k_index [N, k] int64)
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.init_std = config.moe_init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router_logits = nn.functional.linear(hidden_states.float(), self.weight.float())  # [N, E]
        probs = router_logits.softmax(dim=-1)
        top_k_weights, top_k_index = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
        return router_logits, top_k_weights.to(hidden_states.dtype), top_k_index

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"
