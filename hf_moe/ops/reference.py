"""Pure-torch dispatch ops: the reference every compiled kernel is tested against.

Notation: N tokens, k experts per token, E experts, H hidden size, M = N * k (token, slot) pairs. A pair is
identified by its slot id `s = token * k + slot`, the position of its expert id in `top_k_index.view(-1)`.

The dispatch sorts the M pairs by expert (stable, so tokens keep their order inside an expert), which makes
every expert's rows one contiguous group:

    sorted_slots [M]   slot id of the pair at each sorted position
    slot_to_row  [M]   sorted position of each slot id (the inverse permutation)
    tokens_per_expert [E]

None of these ops reads a device tensor on the host; `grouped_linear` does on CPU, where that is free.
"""

from __future__ import annotations

import torch
from torch.autograd import Function


def expert_histogram(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert.

    Args:
        top_k_index: [N, k] expert ids.
    Returns:
        [E] int64 counts; ids outside [0, E) are not counted.
    """
    flat = top_k_index.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    # scatter_add rather than bincount: bincount sizes its output from the data, a host sync on CUDA.
    return counts.scatter_add_(0, flat.clamp(0, num_experts - 1), valid.to(torch.int64))


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Position assignment: the permutation that groups the (token, slot) pairs by expert.

    Args:
        top_k_index: [N, k] expert ids in [0, E).
    Returns:
        sorted_slots [M] int64, slot_to_row [M] int64, tokens_per_expert [E] int64.
    """
    flat = top_k_index.reshape(-1)
    sorted_slots = torch.argsort(flat, stable=True)
    slot_to_row = torch.empty_like(sorted_slots)
    slot_to_row[sorted_slots] = torch.arange(flat.numel(), device=flat.device)
    return sorted_slots, slot_to_row, expert_histogram(top_k_index, num_experts)


class _Permute(Function):
    @staticmethod
    def forward(ctx, hidden_states, sorted_slots, slot_to_row, top_k):
        ctx.save_for_backward(slot_to_row)
        ctx.top_k = top_k
        return hidden_states.index_select(0, torch.div(sorted_slots, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad_rows):
        (slot_to_row,) = ctx.saved_tensors
        # Each token has k rows; gather them back into (token, slot) order and add them up (no scatter).
        grad = grad_rows.index_select(0, slot_to_row).view(-1, ctx.top_k, grad_rows.shape[-1]).sum(1)
        return grad, None, None, None


def permute(hidden_states: torch.Tensor, sorted_slots: torch.Tensor, slot_to_row: torch.Tensor, top_k: int):
    """Gather each token's row once per slot, in expert order.

    Args:
        hidden_states: [N, H]; sorted_slots, slot_to_row: [M] from `sort_by_expert`.
    Returns:
        [M, H], row r holding the token of slot `sorted_slots[r]`.
    """
    return _Permute.apply(hidden_states, sorted_slots, slot_to_row, top_k)


class _Unpermute(Function):
    @staticmethod
    def forward(ctx, rows, sorted_slots, slot_to_row, top_k_weights):
        n, k = top_k_weights.shape
        by_token = rows.index_select(0, slot_to_row).view(n, k, rows.shape[-1])  # [N, k, H]
        weights = top_k_weights.to(rows.dtype)
        ctx.save_for_backward(sorted_slots, weights, by_token if top_k_weights.requires_grad else None)
        ctx.weights_dtype = top_k_weights.dtype
        return torch.bmm(weights.unsqueeze(1), by_token).squeeze(1)

    @staticmethod
    def backward(ctx, grad_out):
        sorted_slots, weights, by_token = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_rows = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_by_token = weights.unsqueeze(-1) * grad_out.unsqueeze(1)  # [N, k, H]
            grad_rows = grad_by_token.view(-1, grad_out.shape[-1]).index_select(0, sorted_slots)
        if ctx.needs_input_grad[3]:
            grad_weights = torch.bmm(by_token, grad_out.unsqueeze(-1)).squeeze(-1).to(ctx.weights_dtype)
        return grad_rows, None, None, grad_weights


def unpermute(rows: torch.Tensor, sorted_slots: torch.Tensor, slot_to_row: torch.Tensor, top_k_weights: torch.Tensor):
    """Weighted combine: each token's output is the sum of its k expert rows times their routing weights.

    Args:
        rows: [M, H] expert outputs in expert order; top_k_weights: [N, k].
    Returns:
        [N, H] in `rows.dtype`.
    """
    return _Unpermute.apply(rows, sorted_slots, slot_to_row, top_k_weights)


class _GroupedLinearLoop(Function):
    """`y[g] = x[g] @ weight[e].T + bias[e]` for each expert's row group g, one matmul per non-empty expert."""

    @staticmethod
    def forward(ctx, x, weight, bias, group_sizes):
        out = x.new_empty(x.shape[0], weight.shape[1])
        start = 0
        for e, size in enumerate(group_sizes):
            if size:
                end = start + size
                if bias is None:
                    torch.mm(x[start:end], weight[e].t(), out=out[start:end])
                else:
                    torch.addmm(bias[e], x[start:end], weight[e].t(), out=out[start:end])
                start = end
        out[start:].zero_()  # rows past the last group (dropped pairs) contribute nothing
        ctx.save_for_backward(x, weight)
        ctx.group_sizes = group_sizes
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = x.new_empty(x.shape) if need_x else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = weight.new_zeros(weight.shape[:2]) if need_b else None
        start = 0
        for e, size in enumerate(ctx.group_sizes):
            if size:
                end = start + size
                g = grad_out[start:end]
                if need_x:
                    torch.mm(g, weight[e], out=grad_x[start:end])
                if need_w:
                    torch.mm(g.t(), x[start:end], out=grad_w[e])
                if need_b:
                    torch.sum(g, dim=0, out=grad_b[e])
                start = end
            elif need_w:
                grad_w[e].zero_()  # an expert with no tokens gets no gradient
        if need_x:
            grad_x[start:].zero_()
        return grad_x, grad_w, grad_b, None


def _can_use_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None)
    return (
        grouped_mm is not None
        and x.is_cuda
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
    )


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    bias: torch.Tensor | None = None,
    group_sizes: list[int] | None = None,
) -> torch.Tensor:
    """Grouped matrix product over contiguous row groups, one group per expert.

    Args:
        x: [M, K], rows sorted by expert.
        weight: [E, N, K] (the `nn.Linear` layout of each expert).
        tokens_per_expert: [E] row count of each group; the groups cover x's first sum(...) rows.
        bias: [E, N] or None.
        group_sizes: `tokens_per_expert` on the host, if the caller already has it.
    Returns:
        [M, N].

    On CUDA (sm80+, bf16) this is `torch.nn.functional.grouped_mm` with device-side offsets: no host sync. Elsewhere
    it is one matmul per non-empty expert, which on CPU is faster than `grouped_mm` and needs the group sizes on
    the host (free on CPU).
    """
    if group_sizes is None and _can_use_grouped_mm(x, weight):
        offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        out = torch.nn.functional.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
        if bias is not None:
            expert_of_row = torch.repeat_interleave(
                torch.arange(weight.shape[0], device=x.device), tokens_per_expert, output_size=x.shape[0]
            )
            out = out + bias.index_select(0, expert_of_row)
        return out
    if group_sizes is None:
        group_sizes = tokens_per_expert.tolist()
    return _GroupedLinearLoop.apply(x, weight, bias, group_sizes)
