"""Auxiliary MoE losses, computed in fp32."""

from __future__ import annotations

import torch


def _token_weight(num_tokens: int, token_mask: torch.Tensor | None, device) -> torch.Tensor:
    if token_mask is None:
        return torch.ones(num_tokens, device=device)
    return token_mask.reshape(-1).to(device=device, dtype=torch.float32)


def load_balancing_loss(
    router_probs: torch.Tensor,
    top_k_index: torch.Tensor,
    num_experts: int,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch Transformer load-balancing loss of one MoE layer, on transformers' scale.

    With f_e the fraction of the tokens that chose expert e among their k choices (so sum_e f_e = k), and P_e the
    mean router probability of expert e over the tokens:

        loss = E * sum_e f_e * P_e

    It is k when routing is uniform (1 for top-1, as in Switch). This is the scale of transformers'
    `load_balancing_loss_func` (Mixtral's, which TRL's trainers compute from the backbone's `router_logits`), so a
    `router_aux_loss_coef` weighs the balancing loss the same under `transformers.Trainer`, TRL's SFT, DPO and GRPO
    trainers and a plain loop. (transformers pools the router logits of all layers before taking the product;
    the model averages the layers' losses, so that each layer is balanced on its own routing.) The choices are the
    router's, before capacity drops: the loss pushes toward the balance that would avoid them.

    Args:
        router_probs: [N, E] routing distribution (any float dtype; upcast to fp32).
        top_k_index: [N, k] chosen experts; ids outside [0, E) (slots a router chose not to send) are ignored.
        token_mask: [N] bool or 0/1, True for real tokens; padding is left out of both f and P.
    Returns:
        fp32 scalar.
    """
    probs = router_probs.float()
    weight = _token_weight(probs.shape[0], token_mask, probs.device)
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    counts = torch.zeros(num_experts, device=probs.device, dtype=torch.float32)
    counts.scatter_add_(0, flat.clamp(0, num_experts - 1), weight.repeat_interleave(k) * valid)
    num_tokens = weight.sum().clamp_min(1.0)
    fraction = counts / num_tokens  # f_e; no gradient: it comes from an argmax
    mean_prob = (probs * weight.unsqueeze(-1)).sum(0) / num_tokens  # P_e
    return num_experts * torch.dot(fraction, mean_prob)


def router_z_loss(router_logits: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE router z-loss of one layer: mean over tokens of logsumexp(logits)^2, in fp32.

    Args:
        router_logits: [N, E]; token_mask: [N], True for real tokens.
    """
    z = torch.logsumexp(router_logits.float(), dim=-1) ** 2  # [N]
    weight = _token_weight(z.shape[0], token_mask, z.device)
    return (z * weight).sum() / weight.sum().clamp_min(1.0)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `output` forward; backward also sends a gradient of 1 to `aux_loss` (Megatron-Core's
    `MoEAuxLossAutoScaler`)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss)


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """`output`, unchanged, carrying `aux_loss` (a scalar, its coefficients included) into the backward: whatever
    loss is computed from `output`, its backward also differentiates `aux_loss`, as if it had been added to that
    loss once. For trainers that compute their loss from a model's logits and would drop the routers' losses
    (TRL's `RewardTrainer`). A trainer that scales its loss (gradient accumulation, fp16 loss scaling) does not
    scale this term."""
    return _AttachAuxLoss.apply(output, aux_loss)
