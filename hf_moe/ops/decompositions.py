"""Every hf_moe op written in standard ATen ops: the decompositions that let any exporter translate a program holding
them, ONNX first.

`torch.export` keeps each hf_moe op as one node (so a saved `.pt2` runs our kernels). `torch.onnx.export` of such a
program (what transformers' ONNX exporter does: `torch.export` first, then the conversion) decomposes, before it
translates, every op found in torch's decomposition table; `register` puts the functions below there for the ops of
`hf_moe::` (library.py), `hf_moe_torch::` (reference.py) and `hf_moe_triton::` (triton/ops.py). Nothing changes
for eager code, `torch.compile` or `torch.export`, which run the ops' own kernels; FakeTensor computes the output
shapes of an op with symbolic sizes from its decomposition, so each one returns exactly the shapes, dtypes and
(contiguous) layout of the op's kernels (tests/test_decompositions.py checks values and metadata, op by op).

Each function has the schema of its op, computes the same values (to float rounding), and is traceable with
symbolic sizes: no host read, no loop whose trip count depends on the data, no stable sort (which ONNX lacks).

    moe_experts_forward, moe_experts_infer   dense.py: every expert on every token, weighted by the routing
                                             (E / k times the expert FLOPs; an [E, N, W] intermediate)
    grouped_mm                               every row through every expert, [E, M, out], then each row's own
    grouped_mm_weight_grad                   a one-hot [E, M] mask of the row groups, one batched product
    sort_by_expert, permute, unpermute, expert_act, expert_act_backward
                                             the pure-torch ops of reference.py (already traceable)
    moe_experts_backward                     experts.composed_backward over the functions above
    linear_infer, decode_attention_block     the decode step's ops: their pure-torch references (decode.py), int8
                                             weights dequantized, the caches written with index_copy_

(The C++ extension's `hf_moe::infer_isa() -> str` names the kernel set of this CPU: it has no tensor to compute,
and a program only ever holds it as a dead node, which the exporters drop.)
"""

from __future__ import annotations

import torch

from ..compat import register_decomposition
from . import dense
from .decode import decode_attention_block_reference, linear_infer_reference
from .experts import DispatchOps, composed_backward
from .int8 import compute_weights
from .reference import expert_act, expert_act_backward, permute, sort_by_expert, unpermute


def _expert_of_row(tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """[M] int64: the expert whose row group holds each row; E for the rows past the last group (dropped pairs)."""
    ends = torch.cumsum(tokens_per_expert, 0)
    return (torch.arange(rows, device=ends.device).unsqueeze(1) >= ends.unsqueeze(0)).sum(1)


def grouped_mm(x, weight, tokens_per_expert, bias, bias_scale, transpose_weight, gather_index=None, top_k=1):
    """`grouped_mm` [M, K] -> [M, out] (and the Triton op's gather inside the GEMM: rows = permute(x, gather_index,
    top_k)). Rows past the last group are zero."""
    rows = x if gather_index is None else permute(x, gather_index, top_k)
    num_experts, m = weight.shape[0], rows.shape[0]
    w = weight.transpose(-2, -1) if transpose_weight else weight  # [E, K, out]
    every = torch.matmul(rows, w)  # [E, M, out]
    if bias is not None:
        scale = 1 if bias_scale is None else bias_scale.to(bias.dtype).view(1, m, 1)
        every = every + bias.unsqueeze(1) * scale
    expert = _expert_of_row(tokens_per_expert, m)
    picked = every.gather(0, expert.clamp_max(num_experts - 1).view(1, m, 1).expand(1, m, w.shape[-1])).squeeze(0)
    return torch.where((expert < num_experts).unsqueeze(1), picked, picked.new_zeros(())).contiguous()


def grouped_mm_weight_grad(grad_out, x, tokens_per_expert, gather_index=None, top_k=1, gather=""):
    """`grouped_mm_weight_grad` [E, A, B]: grad_out[g]^T @ x[g] for each expert's row group g (zero without rows);
    the Triton op's `gather` ("grad_out" or "x") permutes that operand first."""
    if gather == "grad_out":
        grad_out = permute(grad_out, gather_index, top_k)
    elif gather == "x":
        x = permute(x, gather_index, top_k)
    num_experts = tokens_per_expert.shape[0]
    expert = _expert_of_row(tokens_per_expert, x.shape[0])
    mask = (expert.unsqueeze(0) == torch.arange(num_experts, device=expert.device).unsqueeze(1)).to(grad_out.dtype)
    return torch.matmul((mask.unsqueeze(-1) * grad_out).transpose(1, 2), x).contiguous()  # [E, A, M] @ [M, B]


DECOMPOSED = DispatchOps(
    "decomposed", sort_by_expert, permute, unpermute, grouped_mm, grouped_mm_weight_grad, expert_act,
    expert_act_backward,
)


def moe_experts_forward(x, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu, save_h):
    """`moe_experts_forward`: (out [N, H], h [M, W] or [0, W], sorted_slots, slot_to_row, tokens_per_expert,
    row_weight), `out` computed densely (dense.py)."""
    sorted_slots, slot_to_row, tokens_per_expert = sort_by_expert(top_k_index, w1.shape[0])
    row_weight = top_k_weights.reshape(-1).index_select(0, sorted_slots)
    out = dense.experts_forward(x, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu)
    if save_h:
        h = grouped_mm(permute(x, sorted_slots, top_k_index.shape[-1]), w1, tokens_per_expert, b1, None, True)
    else:
        h = x.new_empty(0, w1.shape[1])
    return out, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight


def moe_experts_backward(grad_out, x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight, w1, b1, w2, b2,
                         activation, glu, need_x, need_weights, need_params):
    """`moe_experts_backward`: the six gradients, [0] where not asked for (or without that bias)."""
    grads = composed_backward(DECOMPOSED, grad_out, x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight,
                              w1, b1, w2, b2, activation, glu, need_x, need_weights, need_params)
    return tuple(x.new_empty(0) if g is None else g.contiguous() for g in grads)


def moe_experts_infer(x, top_k_index, top_k_weights, w1, w1_scale, b1, w2, w2_scale, b2, activation, glu,
                      kernels="auto"):
    """`moe_experts_infer` [N, H] -> [N, H]: int8 weights dequantized (int8.py), then the dense forward."""
    w1, b1, w2, b2 = compute_weights(x.dtype, w1, w1_scale, b1, w2, w2_scale, b2)
    return dense.experts_forward(x, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu)


# op name -> its decomposition. reference.py's pure-torch ops are traceable as they are: their own decompositions.
DECOMPOSITIONS = {
    **{op.__name__: op for op in (sort_by_expert, permute, unpermute, expert_act, expert_act_backward)},
    **{op.__name__: op for op in (grouped_mm, grouped_mm_weight_grad, moe_experts_forward, moe_experts_backward,
                                  moe_experts_infer)},
    "linear_infer": linear_infer_reference,
    "decode_attention_block": decode_attention_block_reference,
}


def register(namespace: str) -> list[str]:
    """Register the decomposition of every op of `namespace` named in DECOMPOSITIONS; returns the ops' names."""
    ops = getattr(torch.ops, namespace)
    names = [name for name in DECOMPOSITIONS if hasattr(ops, name)]
    for name in names:
        register_decomposition(getattr(ops, name).default, DECOMPOSITIONS[name])
    return names
