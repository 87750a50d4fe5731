"""The expert computation of one MoE layer, built from the dispatch ops, with a memory-lean backward.

Forward, for rows sorted by expert (M = N * k rows, routing weight w_r of each row):

    rows = permute(x)                          [M, H]
    h    = grouped_mm(rows, W1) + b1           [M, 2I] (GLU) or [M, I]
    a    = act(h) * w_r                        [M, I]   routing weight folded in before the down projection
    y    = grouped_mm(a, W2) + w_r * b2        [M, H]
    out  = unpermute(y)                        [N, H]   plain sum of each token's k rows

The backward keeps only `x`, `h` and the sort (no [M, H] tensors): it re-gathers `rows` and recomputes `a`,
so the activations saved for backward are fewer than a dense MLP's of intermediate size k*I
(x, h: H + 2kI numbers per token, against H + 4kI for the dense SwiGLU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import infer
from .reference import (
    expert_act, expert_act_backward, grouped_mm, grouped_mm_weight_grad, permute, sort_by_expert, unpermute,
)


@dataclass(frozen=True)
class DispatchOps:
    """One implementation of each op (pure-torch `reference` or compiled `torch.ops.hf_moe`), and its name.

    `whole_forward` / `whole_backward`, when set, run the whole computation in one call each (compiled CPU, Triton),
    with the schemas of `hf_moe::moe_experts_forward` / `moe_experts_backward`. `whole_forward` must be differentiable
    by itself (`autograd.register_experts(op, whole_backward)`), so that tracers, torch.export included, keep it
    as one node that runs with gradients. Otherwise `ExpertsFunction` composes the ops below; an exported program
    then differentiates the ops of its forward one by one, so those need backward formulas too (autograd.py).
    """

    name: str
    sort_by_expert: Callable
    permute: Callable
    unpermute: Callable
    grouped_mm: Callable
    grouped_mm_weight_grad: Callable
    expert_act: Callable
    expert_act_backward: Callable
    whole_forward: Callable | None = None
    whole_backward: Callable | None = None


def whole_forward_fake(hidden_states, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu, save_h):
    """Shape function of every backend's `moe_experts_forward` (for torch.compile / torch.export):
    (out [N, H], h [M, W] or [0, W] without save_h, sorted_slots [M], slot_to_row [M], tokens_per_expert [E],
    row_weight [M])."""
    m, new = top_k_index.numel(), hidden_states.new_empty
    long = dict(dtype=torch.int64)
    return (
        new(hidden_states.shape), new(m if save_h else 0, w1.shape[1]), new(m, **long), new(m, **long),
        new(w1.shape[0], **long), new(m),
    )


def whole_backward_fake(grad_out, x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight, w1, b1, w2, b2,
                        activation, glu, need_x, need_weights, need_params):
    """Shape function of every backend's `moe_experts_backward`: (grad_x, grad_top_k_weights [N, k], grad_w1,
    grad_b1, grad_w2, grad_b2), each [0] when not asked for (or without that bias)."""
    top_k = sorted_slots.shape[0] // x.shape[0] if x.shape[0] else 1
    return (
        x.new_empty(x.shape) if need_x else x.new_empty(0),
        row_weight.new_empty(x.shape[0], top_k) if need_weights else x.new_empty(0),
        torch.empty_like(w1) if need_params else x.new_empty(0),
        torch.empty_like(b1) if need_params and b1 is not None else x.new_empty(0),
        torch.empty_like(w2) if need_params else x.new_empty(0),
        torch.empty_like(b2) if need_params and b2 is not None else x.new_empty(0),
    )


def composed_forward(ops: DispatchOps, x, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu, save_h=True):
    """The forward of the module docstring from `ops`, with the whole-layer op's outputs (see `whole_forward_fake`)."""
    top_k = top_k_index.shape[-1]
    sorted_slots, slot_to_row, tokens_per_expert = ops.sort_by_expert(top_k_index, w1.shape[0])
    row_weight = top_k_weights.reshape(-1).index_select(0, sorted_slots)  # [M]
    rows = ops.permute(x, sorted_slots, top_k)
    h = ops.grouped_mm(rows, w1, tokens_per_expert, b1, None, True)
    del rows
    a = ops.expert_act(h, row_weight, activation, glu)
    y = ops.grouped_mm(a, w2, tokens_per_expert, b2, row_weight if b2 is not None else None, True)
    out = ops.unpermute(y, slot_to_row, None, top_k)
    return out, h if save_h else h.new_empty(0, h.shape[1]), sorted_slots, slot_to_row, tokens_per_expert, row_weight


def composed_backward(ops: DispatchOps, grad_out, x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight, w1,
                      b1, w2, b2, activation, glu, need_x, need_weights, need_params):
    """The backward from `ops`: (grad_x [N, H], grad_top_k_weights [N, k] in row_weight's dtype, grad_w1, grad_b1,
    grad_w2, grad_b2), each None where not asked for. `need_params` is one flag, or (w1, b1, w2, b2) flags."""
    need_w1, need_b1, need_w2, need_b2 = need_params if isinstance(need_params, tuple) else (need_params,) * 4
    need_b1, need_b2 = need_b1 and b1 is not None, need_b2 and b2 is not None
    top_k = sorted_slots.shape[0] // x.shape[0] if x.shape[0] else 1
    grad_x = grad_weights = grad_w1 = grad_b1 = grad_w2 = grad_b2 = None
    g = ops.permute(grad_out.contiguous(), sorted_slots, top_k)  # [M, H]: grad of each row of y
    grad_a = ops.grouped_mm(g, w2, tokens_per_expert, None, None, False)  # [M, I]
    # The backward of the activation recomputes it, and hands back `a` (= act(h) * w) for grad_w2.
    grad_h, grad_row_weight, a = ops.expert_act_backward(grad_a, h, row_weight, activation, glu, need_w2)
    del grad_a
    if need_w2:
        grad_w2 = ops.grouped_mm_weight_grad(g, a, tokens_per_expert)
    del a
    if need_b2:
        grad_b2 = ops.grouped_mm_weight_grad(g, row_weight.to(g.dtype).unsqueeze(1), tokens_per_expert)[..., 0]
    if need_weights:
        if b2 is not None:  # d/dw_r of w_r * b2[e] . g_r
            bias_term = ops.grouped_mm(g, b2.unsqueeze(1), tokens_per_expert, None, None, True)[:, 0]
            grad_row_weight = grad_row_weight + bias_term.to(grad_row_weight.dtype)
        grad_weights = grad_row_weight.index_select(0, slot_to_row).view(-1, top_k)
    del g
    if need_w1:
        rows = ops.permute(x, sorted_slots, top_k)
        grad_w1 = ops.grouped_mm_weight_grad(grad_h, rows, tokens_per_expert)
        del rows
    if need_b1:
        ones = grad_h.new_ones(grad_h.shape[0], 1)
        grad_b1 = ops.grouped_mm_weight_grad(grad_h, ones, tokens_per_expert)[..., 0]
    if need_x:
        grad_rows = ops.grouped_mm(grad_h, w1, tokens_per_expert, None, None, False)  # [M, H]
        grad_x = ops.unpermute(grad_rows, slot_to_row, None, top_k)
    return grad_x, grad_weights, grad_w1, grad_b1, grad_w2, grad_b2


REFERENCE = DispatchOps(
    "torch", sort_by_expert, permute, unpermute, grouped_mm, grouped_mm_weight_grad, expert_act, expert_act_backward,
)


def reference_forward(x, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu, save_h):
    """`hf_moe::moe_experts_forward` in pure torch (its default kernel, library.py)."""
    return composed_forward(REFERENCE, x, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu, save_h)


def reference_backward(grad_out, x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight, w1, b1, w2, b2,
                       activation, glu, need_x, need_weights, need_params):
    """`hf_moe::moe_experts_backward` in pure torch: [0] where a gradient is not asked for."""
    grads = composed_backward(REFERENCE, grad_out, x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight, w1,
                              b1, w2, b2, activation, glu, need_x, need_weights, need_params)
    return tuple(x.new_empty(0) if g is None else g for g in grads)


class ExpertsFunction(torch.autograd.Function):
    """The expert computation composed from the ops of a `DispatchOps` without whole-layer ops."""

    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu, ops: DispatchOps):
        ctx.activation, ctx.glu, ctx.ops = activation, glu, ops
        ctx.top_k, ctx.weights_dtype = top_k_index.shape[-1], top_k_weights.dtype
        out, h, *plan = composed_forward(ops, x, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu)
        ctx.save_for_backward(x, h, *plan, w1, b1, w2, b2)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight, w1, b1, w2, b2 = ctx.saved_tensors
        need_x, _, need_weights, *need_params = ctx.needs_input_grad[:7]
        grads = composed_backward(ctx.ops, grad_out, x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight,
                                  w1, b1, w2, b2, ctx.activation, ctx.glu, need_x, need_weights, tuple(need_params))
        grad_x, grad_weights, *grad_params = grads
        if grad_weights is not None:
            grad_weights = grad_weights.reshape(-1, ctx.top_k).to(ctx.weights_dtype)
        return grad_x, None, grad_weights, *grad_params, None, None, None


def run_experts(
    ops: DispatchOps,
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
    """[N, H] -> [N, H] through each token's k experts (see the module docstring)."""
    x = hidden_states.contiguous()
    weights = top_k_weights.to(x.dtype)
    if ops.whole_forward is None:
        return ExpertsFunction.apply(x, top_k_index, weights, w1, b1, w2, b2, activation, glu, ops)
    # The whole-layer op keeps h for its backward only when one will run (h is [M, 2I]: inference does without it).
    save_h = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weights, w1, b1, w2, b2))
    if ops.name == "compiled" and infer.runs(x, w1, w2, save_h):  # inference on CPU: infer.py says when
        return infer.experts_infer(x, top_k_index, weights, w1, None, b1, w2, None, b2, activation, glu)
    return ops.whole_forward(x, top_k_index, weights, w1, b1, w2, b2, activation, glu, save_h)[0]
