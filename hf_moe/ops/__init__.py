"""Dispatch ops and the expert computation built from them.

`experts_forward` is the one entry point the MoE block uses. It runs

    sort_by_expert -> permute -> grouped_linear (gate_up or up) -> activation -> grouped_linear (down) -> unpermute

with the pure-torch ops of `reference.py`. Those are always available and are the oracle for any compiled
kernel. `backend_report()` says which implementation each op uses and why (`python -m hf_moe.env`).
"""

from __future__ import annotations

import torch

from .reference import (
    _can_use_grouped_mm,
    expert_histogram,
    grouped_linear,
    permute,
    sort_by_expert,
    unpermute,
)

__all__ = [
    "backend_report",
    "expert_histogram",
    "experts_forward",
    "grouped_linear",
    "permute",
    "sort_by_expert",
    "unpermute",
]


def experts_forward(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Run each token through its k experts and combine the outputs with the routing weights.

    `experts` follows transformers' fused-experts layout: `num_experts`, `has_gate`, `act_fn`, and either
    `gate_up_proj` [E, 2I, H] (gate rows first) or `up_proj` [E, I, H], then `down_proj` [E, H, I], with
    optional `*_bias` [E, out].

    Args:
        hidden_states: [N, H]; top_k_index: [N, k] int; top_k_weights: [N, k].
    Returns:
        [N, H] in `hidden_states.dtype`.
    """
    top_k = top_k_index.shape[-1]
    sorted_slots, slot_to_row, tokens_per_expert = sort_by_expert(top_k_index, experts.num_experts)
    first = experts.gate_up_proj if experts.has_gate else experts.up_proj
    # One host read of the group sizes per layer, and only where it costs nothing (see grouped_linear).
    sizes = None if _can_use_grouped_mm(hidden_states, first) else tokens_per_expert.tolist()

    rows = permute(hidden_states, sorted_slots, slot_to_row, top_k)  # [M, H]
    if experts.has_gate:
        h = grouped_linear(rows, experts.gate_up_proj, tokens_per_expert, experts.gate_up_proj_bias, sizes)
        gate, up = h.chunk(2, dim=-1)
        h = experts.act_fn(gate) * up  # [M, I]
    else:
        h = experts.act_fn(grouped_linear(rows, experts.up_proj, tokens_per_expert, experts.up_proj_bias, sizes))
    rows = grouped_linear(h, experts.down_proj, tokens_per_expert, experts.down_proj_bias, sizes)  # [M, H]
    return unpermute(rows, sorted_slots, slot_to_row, top_k_weights).to(hidden_states.dtype)


def backend_report() -> dict[str, tuple[str, str]]:
    """{op: (implementation, why)} for the current process."""
    cuda = torch.cuda.is_available()
    gemm = (
        ("torch.nn.functional.grouped_mm", "CUDA sm80+ with bf16 weights; other dtypes use one matmul per expert")
        if cuda and hasattr(torch.nn.functional, "grouped_mm")
        else ("torch.mm per non-empty expert", "CPU: faster than torch's CPU grouped_mm; group sizes are read on host")
    )
    why = "pure-torch reference (no compiled extension in this build)"
    return {
        "expert_histogram": ("torch scatter_add", why),
        "sort_by_expert": ("torch.argsort (stable)", why),
        "permute": ("torch index_select, gather backward", why),
        "grouped_linear": gemm,
        "unpermute": ("torch index_select + bmm", why),
    }
