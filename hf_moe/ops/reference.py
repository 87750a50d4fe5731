"""Pure-torch dispatch and expert ops: always available, and the oracle every compiled kernel is tested against.

Each function has the schema of the compiled op of the same name (`torch.ops.hf_moe.<name>`, csrc/ops.cpp).

Notation: N tokens, k experts per token, E experts, H hidden size, M = N * k (token, slot) pairs. A pair is
identified by its slot id `s = token * k + slot`, the position of its expert id in `top_k_index.view(-1)`.
Dispatch sorts the pairs by expert (stably), which makes every expert's rows one contiguous group:

    sorted_slots [M]        slot id of the pair at each sorted row
    slot_to_row  [M]        sorted row of each slot id (the inverse permutation)
    tokens_per_expert [E]   group sizes; pairs whose expert id is outside [0, E) ("dropped") sort after all groups

None of these ops reads a CUDA tensor on the host. `grouped_mm` reads the group sizes on the host on CPU, where
that is free, and on CUDA without `grouped_mm` support (a fallback with one sync).

Everything here traces (`torch.compile(fullgraph=True)`, `torch.export`): the one loop whose trip count depends on
the data, over the experts' row groups, is the body of two torch.library ops, `hf_moe_torch::grouped_mm` and
`hf_moe_torch::grouped_mm_weight_grad`, which a tracer records as one node each (with a shape function, and a
backward formula for `grouped_mm`, see autograd.py). Loop-free formulations cost E times the FLOPs (every row
through every expert: dense.py, for ONNX) or an [M, K, out] gather of the weights. `torch.nn.functional.grouped_mm`
runs instead where it is torch's fast path, bf16 on sm90 (`torch_grouped_mm_usable`; the Triton backend calls it
there too).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from .autograd import register_grouped_mm

# Kernel activation name -> ACT2FN key. Other ACT2FN keys work here too (only here).
KERNEL_ACTIVATIONS = {
    "silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "relu2": "relu2",
}


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int):
    """Position assignment: the stable permutation that groups the (token, slot) pairs by expert.

    Args:
        top_k_index: [N, k] expert ids; ids outside [0, E) are dropped pairs.
    Returns:
        sorted_slots [M] int64, slot_to_row [M] int64, tokens_per_expert [E] int64 (dropped pairs not counted).
    """
    flat = top_k_index.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    bucket = torch.where(valid, flat, num_experts)
    slots = torch.arange(flat.numel(), device=flat.device)
    # A stable sort by expert, written as a sort of distinct keys (expert, slot): the same permutation, and an op
    # every exporter translates (ONNX has no stable sort, `aten.sort.stable`). Out-of-place ops only: this is also
    # the decomposition of the sort ops (decompositions.py).
    sorted_slots = torch.argsort(bucket * flat.numel() + slots)
    slot_to_row = torch.empty_like(sorted_slots).scatter(0, sorted_slots, slots)
    # scatter_add rather than bincount: bincount sizes its output from the data, a host sync on CUDA.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts = counts.scatter_add(0, bucket, torch.ones_like(bucket))
    return sorted_slots, slot_to_row, counts[:num_experts]


def permute(hidden_states: torch.Tensor, sorted_slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """Gather: [N, H] -> [M, H], row r holding the token of slot `sorted_slots[r]`."""
    return hidden_states.index_select(0, torch.div(sorted_slots, top_k, rounding_mode="floor"))


def unpermute(
    rows: torch.Tensor, slot_to_row: torch.Tensor, top_k_weights: torch.Tensor | None, top_k: int
) -> torch.Tensor:
    """Combine: [M, H] -> [N, H], out[n] = sum_j w[n, j] * rows[slot_to_row[n*k + j]] (w = 1 when None).

    Accumulates in fp32 for low-precision inputs.
    """
    by_token = rows.index_select(0, slot_to_row).view(-1, top_k, rows.shape[-1])  # [N, k, H]
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    if top_k_weights is None:
        return by_token.sum(1, dtype=acc).to(rows.dtype)
    return torch.bmm(top_k_weights.to(acc).unsqueeze(1), by_token.to(acc)).squeeze(1).to(rows.dtype)


# Why torch's grouped GEMM runs only on sm90 (what `python -m hf_moe.env` prints).
GROUPED_MM_WHY = (
    "torch.nn.functional.grouped_mm is torch's fast path (CUTLASS) for bf16 on sm90; on sm100 and newer (B200, B300) "
    "it gives experts without rows non-zero weight gradients (pytorch/pytorch#172439), and elsewhere it is a loop "
    "that copies the group sizes to the host"
)


def torch_grouped_mm_usable(
    device: torch.device,
    dtypes: tuple[torch.dtype, ...],
    dims: tuple[int, ...],
    capability: tuple[int, int] | None = None,
) -> bool:
    """Whether `torch.nn.functional.grouped_mm` is the one to run for these operands (see `GROUPED_MM_WHY`).

    Only bf16 on sm90 (compute capability 9.x): there torch 2.13 runs it with CUTLASS. Not on sm100 and newer, where
    it computes non-zero weight gradients for experts with no rows (pytorch/pytorch#172439), common with many
    experts; not on older GPUs, where it falls back to a loop that copies the offsets to the host. Its operands need
    16-byte aligned strides: every dimension in `dims` a multiple of 8 bf16 elements.

    Args:
        capability: the device's compute capability; None reads it (tests pass a fake one).
    """
    if not hasattr(torch.nn.functional, "grouped_mm") or device.type != "cuda" or torch.version.hip is not None:
        return False
    if any(dtype != torch.bfloat16 for dtype in dtypes) or any(d % 8 for d in dims):
        return False
    major, _ = capability if capability is not None else torch.cuda.get_device_capability(device)
    return major == 9


def _use_grouped_mm(x: torch.Tensor, weight: torch.Tensor, out_dim: int) -> bool:
    return torch_grouped_mm_usable(x.device, (x.dtype, weight.dtype), (x.shape[1], out_dim))


def _offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)


def grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    bias: torch.Tensor | None,
    bias_scale: torch.Tensor | None,
    transpose_weight: bool,
) -> torch.Tensor:
    """Grouped matrix product over contiguous row groups, one group per expert.

    Args:
        x: [M, K], rows sorted by expert.
        weight: [E, A, B]; y = x @ weight[e]^T (A out, `transpose_weight`) or x @ weight[e] (B out).
        bias: [E, out], added to each row of expert e, times `bias_scale` [M] when given.
    Returns:
        [M, out]; rows past the last group (dropped pairs) are zero.
    """
    w = weight.transpose(-2, -1) if transpose_weight else weight  # [E, K, out]
    if _use_grouped_mm(x, weight, w.shape[-1]):
        out = torch.nn.functional.grouped_mm(x, w, offs=_offsets(tokens_per_expert))
        covered = torch.arange(x.shape[0], device=x.device) < tokens_per_expert.sum()
        # grouped_mm leaves the rows past the groups unwritten (whatever the allocator held, NaN included): select
        # zeros there (a 0/1 mask would keep NaN, NaN * 0 = NaN).
        out = torch.where(covered.unsqueeze(1), out, out.new_zeros(()))
        if bias is not None:
            rows = torch.arange(x.shape[0], device=x.device)
            expert_of_row = torch.searchsorted(torch.cumsum(tokens_per_expert, 0), rows, right=True)
            b = bias.index_select(0, expert_of_row.clamp_max(weight.shape[0] - 1))
            keep = covered.unsqueeze(1).to(b.dtype)
            out = out + b * (keep if bias_scale is None else keep * bias_scale.unsqueeze(1).to(b.dtype))
        return out
    return torch.ops.hf_moe_torch.grouped_mm(x, weight, tokens_per_expert, bias, bias_scale, transpose_weight)


def grouped_mm_weight_grad(grad_out: torch.Tensor, x: torch.Tensor, tokens_per_expert: torch.Tensor):
    """[E, A, B]: grad_out[g]^T @ x[g] for each expert's row group g (zero for experts without rows).

    Args:
        grad_out: [M, A]; x: [M, B].
    """
    if _use_grouped_mm(x, grad_out, grad_out.shape[1]):
        return torch.nn.functional.grouped_mm(grad_out.t(), x, offs=_offsets(tokens_per_expert))
    return torch.ops.hf_moe_torch.grouped_mm_weight_grad(grad_out, x, tokens_per_expert)


# ----------------------------------------------------------------------------------------------------------------
# The loops over row groups, as torch.library ops (tracers record them as one node; see the module docstring)
# ----------------------------------------------------------------------------------------------------------------
@torch.library.custom_op(
    "hf_moe_torch::grouped_mm", mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor tokens_per_expert, Tensor? bias, Tensor? bias_scale, "
           "bool transpose_weight) -> Tensor",
)
def _grouped_mm_loop(x, weight, tokens_per_expert, bias, bias_scale, transpose_weight):
    w = weight.transpose(-2, -1) if transpose_weight else weight  # [E, K, out]
    out = x.new_empty(x.shape[0], w.shape[-1])
    sizes = tokens_per_expert.tolist()  # free on CPU; one sync on CUDA (only without grouped_mm support)
    out[sum(sizes) :].zero_()  # rows of dropped pairs
    start = 0
    for e, size in enumerate(sizes):
        if size:
            end = start + size
            if bias is None:
                torch.mm(x[start:end], w[e], out=out[start:end])
            elif bias_scale is None:
                torch.addmm(bias[e], x[start:end], w[e], out=out[start:end])
            else:
                torch.mm(x[start:end], w[e], out=out[start:end])
                out[start:end].addr_(bias_scale[start:end].to(out.dtype), bias[e])
            start = end
    return out


@_grouped_mm_loop.register_fake
def _(x, weight, tokens_per_expert, bias, bias_scale, transpose_weight):
    return x.new_empty(x.shape[0], weight.shape[1] if transpose_weight else weight.shape[2])


@torch.library.custom_op(
    "hf_moe_torch::grouped_mm_weight_grad", mutates_args=(),
    schema="(Tensor grad_out, Tensor x, Tensor tokens_per_expert) -> Tensor",
)
def _grouped_mm_weight_grad_loop(grad_out, x, tokens_per_expert):
    out = x.new_empty(tokens_per_expert.shape[0], grad_out.shape[1], x.shape[1])
    start = 0
    for e, size in enumerate(tokens_per_expert.tolist()):
        if size:
            torch.mm(grad_out[start : start + size].t(), x[start : start + size], out=out[e])
            start += size
        else:
            out[e].zero_()
    return out


@_grouped_mm_weight_grad_loop.register_fake
def _(grad_out, x, tokens_per_expert):
    return x.new_empty(tokens_per_expert.shape[0], grad_out.shape[1], x.shape[1])


def _activation(name: str) -> nn.Module:
    return ACT2FN[KERNEL_ACTIVATIONS.get(name, name)]


def expert_act(h: torch.Tensor, row_scale: torch.Tensor | None, activation: str, glu: bool) -> torch.Tensor:
    """[M, W] -> [M, I]: act(gate) * up (GLU, h = [gate | up], I = W / 2) or act(h), times row_scale [M]."""
    act = _activation(activation)
    if glu:
        gate, up = h.chunk(2, dim=-1)
        out = act(gate) * up
    else:
        out = act(h)
    return out if row_scale is None else out * row_scale.to(out.dtype).unsqueeze(1)


def _activation_backward(name: str, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """act'(x) * grad for the kernel activations, None for others."""
    aten = torch.ops.aten
    if name == "silu":
        return aten.silu_backward(grad, x)
    if name in ("gelu", "gelu_tanh"):
        return aten.gelu_backward(grad, x, approximate="tanh" if name == "gelu_tanh" else "none")
    if name == "relu":
        return aten.threshold_backward(grad, x, 0)
    if name == "relu2":
        return grad * x.clamp_min(0) * 2
    return None


def expert_act_backward(
    grad: torch.Tensor,
    h: torch.Tensor,
    row_scale: torch.Tensor | None,
    activation: str,
    glu: bool,
    return_output: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of `expert_act`: (grad_h [M, W], grad_row_scale [M] or [0] without row_scale, and the forward
    output [M, I] when `return_output`, else [0, I]: it is computed on the way, and the caller needs it next)."""
    width = h.shape[1] // 2 if glu else h.shape[1]
    gate = h[:, :width]
    if activation not in KERNEL_ACTIVATIONS:  # any other ACT2FN activation: differentiate it with torch.func
        # (a vjp, not torch.autograd.grad: it works with gradients disabled, and Dynamo traces it in a backward)
        inputs = (h,) if row_scale is None else (h, row_scale)
        out, vjp = torch.func.vjp(lambda h, *scale: expert_act(h, *(scale or (None,)), activation, glu), *inputs)
        grads = vjp(grad)
        output = out if return_output else h.new_empty(0, width)
        return grads[0], (grads[1] if row_scale is not None else h.new_empty(0)), output
    act = _activation(activation)(gate)
    value = act * h[:, width:] if glu else act  # the unscaled output
    grad_scale = h.new_empty(0)
    output = h.new_empty(0, width)
    if row_scale is not None:
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        grad_scale = (grad.to(acc) * value.to(acc)).sum(1).to(row_scale.dtype)
        scale = row_scale.to(grad.dtype).unsqueeze(1)
        grad = grad * scale
        if return_output:
            output = value * scale
    elif return_output:
        output = value
    if glu:  # out-of-place (no out= into a slice): traced backward passes take only functional ops
        grad_h = torch.cat([_activation_backward(activation, grad * h[:, width:], gate), grad * act], dim=1)
    else:
        grad_h = _activation_backward(activation, grad, gate)
    return grad_h, grad_scale, output


register_grouped_mm("hf_moe_torch")  # so that an exported program differentiates it (autograd.py)
