"""Backward formulas of the dispatch ops, registered with `torch.library.register_autograd`.

Eager code and `torch.compile` differentiate a composed expert computation through `ExpertsFunction`
(experts.py). `torch.export` keeps no autograd.Function: it records the ops the Function's forward calls, and an
exported program run with gradients differentiates those ops one by one. So each op that can appear in a forward
has a backward formula of its own here, written with the ops of the same implementation (`namespace`):

    moe_experts_forward   the whole layer (compiled CPU); its backward is `moe_experts_backward`
    grouped_mm            both implementations (`hf_moe_torch::grouped_mm` is the pure-torch loop)
    permute, unpermute, expert_act    compiled (the pure-torch ones are torch functions autograd already knows)

`sort_by_expert` has integer outputs only, and `grouped_mm_weight_grad` and `expert_act_backward` appear only in
backward passes.
"""

from __future__ import annotations

import functools

import torch


def _ops(namespace: str):
    return getattr(torch.ops, namespace)


# ----------------------------------------------------------------------------------------------------------------
# The whole layer: moe_experts_forward(x, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu, save_h)
#   -> (out, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight); only `out` is differentiable.
# ----------------------------------------------------------------------------------------------------------------
def _experts_setup(ctx, inputs, output):
    x, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu, save_h = inputs
    _, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight = output
    ctx.save_for_backward(x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight, w1, b1, w2, b2)
    ctx.activation, ctx.glu, ctx.saved_h = activation, glu, save_h
    ctx.top_k, ctx.weights_dtype = top_k_index.shape[-1], top_k_weights.dtype


def _experts_backward(backward_op, ctx, grad_out, *unused):
    if not ctx.saved_h:
        raise RuntimeError(
            "hf_moe: this expert computation ran with save_h=False (gradients were disabled, or no input required "
            "them, when it was called or traced), so it kept nothing to differentiate. Run it, or trace it for "
            "torch.export, with gradients enabled."
        )
    x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight, w1, b1, w2, b2 = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_x, need_weights, need_params = need[0], need[2], any(need[3:7])
    grads = backward_op(
        grad_out.contiguous(), x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight, w1, b1, w2, b2,
        ctx.activation, ctx.glu, need_x, need_weights, need_params,
    )
    grad_x, grad_weights, grad_w1, grad_b1, grad_w2, grad_b2 = (
        g if wanted else None for g, wanted in zip(grads, (need[0], need[2], need[3], need[4], need[5], need[6]))
    )
    if grad_weights is not None:
        grad_weights = grad_weights.reshape(-1, ctx.top_k).to(ctx.weights_dtype)
    return grad_x, None, grad_weights, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None


def register_experts(forward_op: str, backward_op) -> None:
    """Make `forward_op` (a moe_experts_forward) differentiable, its backward running `backward_op`."""
    torch.library.register_autograd(
        forward_op, functools.partial(_experts_backward, backward_op), setup_context=_experts_setup
    )


# ----------------------------------------------------------------------------------------------------------------
# grouped_mm(x [M, K], weight [E, A, B], tokens_per_expert [E], bias [E, out]?, bias_scale [M]?, transpose_weight)
#   y_r = x_r @ W_e^T (or W_e) + s_r * b_e for row r of expert e
# ----------------------------------------------------------------------------------------------------------------
def _grouped_mm_setup(ctx, inputs, output):
    x, weight, tokens_per_expert, bias, bias_scale, transpose_weight = inputs
    ctx.save_for_backward(x, weight, tokens_per_expert, bias, bias_scale)
    ctx.transpose_weight = transpose_weight


def _grouped_mm_backward(namespace, ctx, grad):
    ops = _ops(namespace)
    x, weight, tokens_per_expert, bias, bias_scale = ctx.saved_tensors
    need = ctx.needs_input_grad
    grad = grad.contiguous()
    grad_x = grad_weight = grad_bias = grad_scale = None
    if need[0]:  # dx_r = g_r @ W_e (or W_e^T)
        grad_x = ops.grouped_mm(grad, weight, tokens_per_expert, None, None, not ctx.transpose_weight)
    if need[1]:  # dW_e = g_e^T @ x_e (or x_e^T @ g_e)
        pair = (grad, x.contiguous()) if ctx.transpose_weight else (x.contiguous(), grad)
        grad_weight = ops.grouped_mm_weight_grad(*pair, tokens_per_expert)
    if bias is not None and need[3]:  # db_e = sum_r s_r g_r
        scale = grad.new_ones(grad.shape[0], 1) if bias_scale is None else bias_scale.to(grad.dtype).unsqueeze(1)
        grad_bias = ops.grouped_mm_weight_grad(grad, scale, tokens_per_expert)[..., 0]
    if bias_scale is not None and need[4]:  # ds_r = g_r . b_e
        grad_scale = ops.grouped_mm(grad, bias.unsqueeze(1), tokens_per_expert, None, None, True)[:, 0]
        grad_scale = grad_scale.to(bias_scale.dtype)
    return grad_x, grad_weight, None, grad_bias, grad_scale, None


# ----------------------------------------------------------------------------------------------------------------
# permute(hidden [N, H], sorted_slots [M], top_k) -> rows [M, H]: row r is token sorted_slots[r] // k
# unpermute(rows [M, H], slot_to_row [M], top_k_weights [N, k]?, top_k) -> [N, H]
# expert_act(h [M, W], row_scale [M]?, activation, glu) -> [M, I]
# ----------------------------------------------------------------------------------------------------------------
def _permute_setup(ctx, inputs, output):
    hidden_states, sorted_slots, top_k = inputs
    ctx.save_for_backward(sorted_slots)
    ctx.top_k, ctx.num_tokens = top_k, hidden_states.shape[0]


def _permute_backward(ctx, grad):
    (sorted_slots,) = ctx.saved_tensors
    tokens = torch.div(sorted_slots, ctx.top_k, rounding_mode="floor")
    return grad.new_zeros(ctx.num_tokens, grad.shape[1]).index_add(0, tokens, grad), None, None


def _unpermute_setup(ctx, inputs, output):
    rows, slot_to_row, top_k_weights, top_k = inputs
    ctx.save_for_backward(rows, slot_to_row, top_k_weights)
    ctx.top_k = top_k


def _unpermute_backward(ctx, grad):
    rows, slot_to_row, weights = ctx.saved_tensors
    n, k, width = grad.shape[0], ctx.top_k, grad.shape[1]
    per_slot = grad.unsqueeze(1).expand(n, k, width)  # [N, k, H]: the gradient of each (token, slot) row
    if weights is not None:
        per_slot = per_slot * weights.to(grad.dtype).unsqueeze(-1)
    grad_rows = torch.zeros_like(rows).index_copy(0, slot_to_row, per_slot.reshape(n * k, width).to(rows.dtype))
    grad_weights = None
    if weights is not None and ctx.needs_input_grad[2]:
        by_slot = rows.index_select(0, slot_to_row).view(n, k, width)
        grad_weights = (by_slot.float() * grad.float().unsqueeze(1)).sum(-1).to(weights.dtype)
    return grad_rows, None, grad_weights, None


def _expert_act_setup(ctx, inputs, output):
    h, row_scale, activation, glu = inputs
    ctx.save_for_backward(h, row_scale)
    ctx.activation, ctx.glu = activation, glu


def _expert_act_backward(namespace, ctx, grad):
    h, row_scale = ctx.saved_tensors
    grad_h, grad_scale, _ = _ops(namespace).expert_act_backward(
        grad.contiguous(), h, row_scale, ctx.activation, ctx.glu, False
    )
    return grad_h, (grad_scale if row_scale is not None else None), None, None


def register_grouped_mm(namespace: str) -> None:
    """Make `{namespace}::grouped_mm` differentiable (its backward uses that namespace's ops)."""
    torch.library.register_autograd(
        f"{namespace}::grouped_mm", functools.partial(_grouped_mm_backward, namespace), setup_context=_grouped_mm_setup
    )


def register_composable(namespace: str) -> None:
    """Make grouped_mm, permute, unpermute and expert_act of `namespace` (the compiled ops) differentiable."""
    register_grouped_mm(namespace)
    torch.library.register_autograd(f"{namespace}::permute", _permute_backward, setup_context=_permute_setup)
    torch.library.register_autograd(f"{namespace}::unpermute", _unpermute_backward, setup_context=_unpermute_setup)
    torch.library.register_autograd(
        f"{namespace}::expert_act", functools.partial(_expert_act_backward, namespace),
        setup_context=_expert_act_setup,
    )
