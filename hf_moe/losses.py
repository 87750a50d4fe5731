"""Auxiliary MoE losses, computed in fp32."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    top_k_index: Sequence[torch.Tensor],
    num_experts: int,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch Transformer load-balancing loss, averaged over MoE layers.

    For one layer, with f_e the fraction of (token, slot) assignments that went to expert e and P_e the mean
    router probability of expert e over the tokens:

        loss = E * sum_e f_e * P_e

    It is 1.0 when routing is uniform, whatever k. (transformers' `load_balancing_loss_func` counts
    assignments per token rather than per slot, so its value is k times this one.)

    Args:
        router_logits: per MoE layer, [N, E] logits (any dtype; upcast to fp32).
        top_k_index: per MoE layer, [N, k] chosen experts.
        token_mask: [N] bool/0-1, True for real tokens; padding is left out of both f and P.
    Returns:
        fp32 scalar.
    """
    losses = []
    for logits, index in zip(router_logits, top_k_index, strict=True):
        probs = logits.float().softmax(dim=-1)  # [N, E]
        k = index.shape[-1]
        if token_mask is None:
            weight = torch.ones(probs.shape[0], device=probs.device)
        else:
            weight = token_mask.reshape(-1).to(device=probs.device, dtype=torch.float32)
        num_tokens = weight.sum().clamp_min(1.0)
        assignments = torch.zeros(num_experts, device=probs.device, dtype=torch.float32)
        assignments.scatter_add_(0, index.reshape(-1), weight.repeat_interleave(k))
        fraction = assignments / (num_tokens * k)  # f_e, no gradient: it comes from an argmax
        mean_prob = (probs * weight.unsqueeze(-1)).sum(0) / num_tokens  # P_e
        losses.append(num_experts * torch.dot(fraction, mean_prob))
    return torch.stack(losses).mean()
