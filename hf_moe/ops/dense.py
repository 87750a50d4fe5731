"""The expert computation in standard tensor ops only: every expert on every token, weighted by the routing.

This is what `torch.onnx.export` records (backend.py switches to it while `torch.onnx.is_in_onnx_export()`): no
custom op, no sort, no loop whose length depends on the data, so every ONNX runtime runs it. The output equals the
sparse computation's: a token's unchosen experts are weighted by exact zeros. It costs E / k times the expert
FLOPs and an [E, N, I] intermediate, which an exported inference graph can afford and a training step would not.

    combine [N, E]  = sum_j w[n, j] * onehot(top_k_index[n, j])      (ids outside [0, E), dropped pairs, weigh 0)
    h       [E, N, W] = x @ W1[e]^T (+ b1[e])
    a       [E, N, I] = act(gate) * up (GLU) or act(h)
    y       [E, N, H] = a @ W2[e]^T (+ b2[e])
    out     [N, H]  = sum_e combine[n, e] * y[e, n]
"""

from __future__ import annotations

import torch

from .reference import expert_act


def experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    activation: str,
    glu: bool,
) -> torch.Tensor:
    """[N, H] -> [N, H]; w1 [E, W, H], b1 [E, W], w2 [E, H, I], b2 [E, H]; top_k_index, top_k_weights [N, k]."""
    num_experts, n = w1.shape[0], hidden_states.shape[0]
    experts = torch.arange(num_experts, device=top_k_index.device)
    onehot = top_k_index.unsqueeze(-1) == experts  # [N, k, E]; all False for a dropped pair
    combine = (onehot.to(hidden_states.dtype) * top_k_weights.to(hidden_states.dtype).unsqueeze(-1)).sum(1)
    h = torch.matmul(hidden_states, w1.transpose(1, 2))  # [E, N, W]
    if b1 is not None:
        h = h + b1.unsqueeze(1)
    a = expert_act(h.reshape(num_experts * n, h.shape[-1]), None, activation, glu).view(num_experts, n, -1)
    y = torch.matmul(a, w2.transpose(1, 2))  # [E, N, H]
    if b2 is not None:
        y = y + b2.unsqueeze(1)
    return (combine.t().unsqueeze(-1) * y).sum(0)
