"""The Triton ops as `torch.library` custom ops (`torch.ops.hf_moe_triton.*`), with fake kernels, and the expert
computation built from them.

The schemas are those of the compiled CPU ops (`torch.ops.hf_moe.*`, library.py) and of `reference.py`;
`grouped_mm` and `grouped_mm_weight_grad` take an optional `gather_index` that reads the row-major operand in
token order (the permute done inside the GEMM). As custom ops they are opaque to `torch.compile` (which traces
around them with the fake kernels) and run inside `ExpertsFunction`, which is their autograd.

Importing this module defines the ops without importing triton (`import hf_moe` does, so a saved exported program
that calls them loads anywhere); the kernels are imported when an op first runs.

A kernel that fails to compile (a Triton compiler error, or a config the GPU cannot hold) does not stop training:
that op runs its pure-torch implementation from then on in the process, after one RuntimeWarning naming the op,
the error and HF_MOE_BACKEND=torch (which skips Triton altogether). Errors of ours (bad arguments) still raise.

`WholeExperts` is the whole forward and backward of `ExpertsFunction` (its `whole_forward` / `whole_backward`),
composed of these ops with the gathers done inside the GEMMs: no [M, H] copy of the tokens or of the output gradient
is made.
"""

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from ..reference import KERNEL_ACTIVATIONS
from ..reference import expert_act as torch_expert_act
from ..reference import expert_act_backward as torch_expert_act_backward
from ..reference import grouped_mm as torch_grouped_mm
from ..reference import grouped_mm_weight_grad as torch_grouped_mm_weight_grad
from ..reference import permute as torch_permute
from ..reference import sort_by_expert as torch_sort_by_expert
from ..reference import unpermute as torch_unpermute
from ..autograd import register_experts
from ..experts import whole_backward_fake, whole_forward_fake

_NS = "hf_moe_triton::"


ACTIVATIONS = tuple(KERNEL_ACTIVATIONS)  # the activation kernels' (triton/activation.py)
fell_back: dict[str, str] = {}  # op -> the compile error that sent it to torch, in this process


def _guarded(op: str, kernel: Callable, fallback: Callable, *args):
    """`kernel(*args)`, or `fallback(*args)` (the pure-torch op) once a Triton kernel of `op` failed to compile."""
    if op in fell_back:
        return fallback(*args)
    from triton.errors import TritonError

    try:
        return kernel(*args)
    except TritonError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        fell_back[op] = f"{type(err).__name__}: {first}"
        warnings.warn(
            f"hf_moe: the Triton kernel of {op} failed to compile ({fell_back[op]}); {op} runs the pure-torch op "
            "from now on in this process (correct, slower). Set HF_MOE_BACKEND=torch to skip the Triton kernels, and "
            "please report this with the output of `python -m hf_moe.env`.",
            RuntimeWarning, stacklevel=2,
        )
        return fallback(*args)


def _torch_gathered_mm(x, weight, tokens_per_expert, bias, bias_scale, transpose_weight, gather_index, top_k):
    rows = x if gather_index is None else torch_permute(x, gather_index, top_k)
    return torch_grouped_mm(rows, weight, tokens_per_expert, bias, bias_scale, transpose_weight)


def _torch_weight_grad(grad_out, x, tokens_per_expert, gather_index, top_k, gather):
    if gather == "grad_out":
        grad_out = torch_permute(grad_out, gather_index, top_k)
    elif gather == "x":
        x = torch_permute(x, gather_index, top_k)
    return torch_grouped_mm_weight_grad(grad_out, x, tokens_per_expert)


@torch.library.custom_op(_NS + "sort_by_expert", mutates_args=())
def sort_by_expert(top_k_index: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    from .routing import sort_by_expert as kernel  # imports triton: on first use only

    return _guarded("sort_by_expert", kernel, torch_sort_by_expert, top_k_index,
                    num_experts)


@sort_by_expert.register_fake
def _(top_k_index, num_experts):
    m = top_k_index.numel()
    new = top_k_index.new_empty
    return new(m, dtype=torch.int64), new(m, dtype=torch.int64), new(num_experts, dtype=torch.int64)


@torch.library.custom_op(_NS + "permute", mutates_args=())
def permute(hidden_states: Tensor, sorted_slots: Tensor, top_k: int) -> Tensor:
    from .permute import permute as kernel  # imports triton: on first use only

    return _guarded("permute", kernel, torch_permute, hidden_states, sorted_slots, top_k)


@permute.register_fake
def _(hidden_states, sorted_slots, top_k):
    return hidden_states.new_empty(sorted_slots.shape[0], hidden_states.shape[1])


@torch.library.custom_op(_NS + "unpermute", mutates_args=())
def unpermute(rows: Tensor, slot_to_row: Tensor, top_k_weights: Optional[Tensor], top_k: int) -> Tensor:
    from .permute import unpermute as kernel  # imports triton: on first use only

    return _guarded("unpermute", kernel, torch_unpermute, rows, slot_to_row, top_k_weights,
                    top_k)


@unpermute.register_fake
def _(rows, slot_to_row, top_k_weights, top_k):
    return rows.new_empty(slot_to_row.shape[0] // top_k, rows.shape[1])


@torch.library.custom_op(_NS + "grouped_mm", mutates_args=())
def grouped_mm(
    x: Tensor,
    weight: Tensor,
    tokens_per_expert: Tensor,
    bias: Optional[Tensor],
    bias_scale: Optional[Tensor],
    transpose_weight: bool,
    gather_index: Optional[Tensor] = None,
    top_k: int = 1,
) -> Tensor:
    from .grouped_gemm import grouped_mm as kernel  # imports triton: on first use only

    return _guarded("grouped_mm", kernel, _torch_gathered_mm, x, weight, tokens_per_expert,
                    bias, bias_scale, transpose_weight, gather_index, top_k)


@grouped_mm.register_fake
def _(x, weight, tokens_per_expert, bias, bias_scale, transpose_weight, gather_index=None, top_k=1):
    m = gather_index.shape[0] if gather_index is not None else x.shape[0]
    return x.new_empty(m, weight.shape[1] if transpose_weight else weight.shape[2])


@torch.library.custom_op(_NS + "grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(
    grad_out: Tensor, x: Tensor, tokens_per_expert: Tensor, gather_index: Optional[Tensor] = None, top_k: int = 1,
    gather: str = "",
) -> Tensor:
    from .grouped_gemm import grouped_mm_weight_grad as kernel  # imports triton: on first use only

    return _guarded("grouped_mm_weight_grad", kernel, _torch_weight_grad,
                    grad_out, x, tokens_per_expert, gather_index, top_k, gather)


@grouped_mm_weight_grad.register_fake
def _(grad_out, x, tokens_per_expert, gather_index=None, top_k=1, gather=""):
    return x.new_empty(tokens_per_expert.shape[0], grad_out.shape[1], x.shape[1])


@torch.library.custom_op(_NS + "expert_act", mutates_args=())
def expert_act(h: Tensor, row_scale: Optional[Tensor], activation: str, glu: bool) -> Tensor:
    from .activation import expert_act as kernel  # imports triton: on first use only

    return _guarded("expert_act", kernel, torch_expert_act, h, row_scale, activation, glu)


@expert_act.register_fake
def _(h, row_scale, activation, glu):
    return h.new_empty(h.shape[0], h.shape[1] // 2 if glu else h.shape[1])


@torch.library.custom_op(_NS + "expert_act_backward", mutates_args=())
def expert_act_backward(
    grad: Tensor, h: Tensor, row_scale: Optional[Tensor], activation: str, glu: bool, return_output: bool
) -> tuple[Tensor, Tensor, Tensor]:
    from .activation import expert_act_backward as kernel  # imports triton: on first use only

    return _guarded("expert_act_backward", kernel, torch_expert_act_backward,
                    grad, h, row_scale, activation, glu, return_output)


@expert_act_backward.register_fake
def _(grad, h, row_scale, activation, glu, return_output):
    scale_dtype = (row_scale if row_scale is not None else h).dtype
    scale = h.new_empty(h.shape[0] if row_scale is not None else 0, dtype=scale_dtype)
    return torch.empty_like(h), scale, h.new_empty(h.shape[0] if return_output else 0, grad.shape[1])


@dataclass(frozen=True)
class WholeExperts:
    """`ExpertsFunction`'s `whole_forward` and `whole_backward` from the Triton ops, with the activation ops given
    (the Triton ones, or the pure-torch ones for activations without a kernel)."""

    expert_act: Callable
    expert_act_backward: Callable

    def forward(self, x, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu, save_h):
        """[N, H] -> (out [N, H], h [M, W], sorted_slots, slot_to_row, tokens_per_expert, row_weight [M]).
        `save_h` is unused: h is computed anyway, and is what the backward keeps."""
        ops = torch.ops.hf_moe_triton
        top_k = top_k_index.shape[-1]
        sorted_slots, slot_to_row, counts = ops.sort_by_expert(top_k_index, w1.shape[0])
        row_weight = top_k_weights.reshape(-1).index_select(0, sorted_slots)  # [M]
        h = ops.grouped_mm(x, w1, counts, b1, None, True, sorted_slots, top_k)  # rows gathered in the GEMM
        a = self.expert_act(h, row_weight, activation, glu)
        y = ops.grouped_mm(a, w2, counts, b2, row_weight if b2 is not None else None, True)
        return ops.unpermute(y, slot_to_row, None, top_k), h, sorted_slots, slot_to_row, counts, row_weight

    def backward(self, grad_out, x, h, sorted_slots, slot_to_row, counts, row_weight, w1, b1, w2, b2, activation, glu,
                 need_x, need_weights, need_params):
        """-> (grad_x [N, H], grad_top_k_weights [N, k], grad_w1, grad_b1, grad_w2, grad_b2); empty where not asked
        for (or without that bias). `ExpertsFunction.backward`'s arithmetic, with g = permute(grad_out) and
        rows = permute(x) read through `sorted_slots` inside the GEMMs."""
        ops = torch.ops.hf_moe_triton
        top_k = sorted_slots.shape[0] // x.shape[0] if x.shape[0] else 1
        empty = x.new_empty(0)
        grad_x = grad_weights = grad_w1 = grad_b1 = grad_w2 = grad_b2 = empty
        grad_a = ops.grouped_mm(grad_out, w2, counts, None, None, False, sorted_slots, top_k)  # [M, I]
        grad_h, grad_row_weight, a = self.expert_act_backward(grad_a, h, row_weight, activation, glu, need_params)
        del grad_a
        if need_params:
            grad_w2 = ops.grouped_mm_weight_grad(grad_out, a, counts, sorted_slots, top_k, "grad_out")
            if b2 is not None:
                grad_b2 = ops.grouped_mm_weight_grad(grad_out, row_weight.unsqueeze(1), counts, sorted_slots, top_k,
                                                     "grad_out")[..., 0]
        del a
        if need_weights:
            if b2 is not None:  # d/dw_r of w_r * b2[e] . g_r
                bias_term = ops.grouped_mm(grad_out, b2.unsqueeze(1), counts, None, None, True, sorted_slots, top_k)
                grad_row_weight = grad_row_weight + bias_term[:, 0].to(grad_row_weight.dtype)
            grad_weights = grad_row_weight.index_select(0, slot_to_row).view(-1, top_k)
        if need_params:
            grad_w1 = ops.grouped_mm_weight_grad(grad_h, x, counts, sorted_slots, top_k, "x")
            if b1 is not None:
                grad_b1 = ops.grouped_mm_weight_grad(grad_h, grad_h.new_ones(grad_h.shape[0], 1), counts)[..., 0]
        if need_x:
            grad_rows = ops.grouped_mm(grad_h, w1, counts, None, None, False)  # [M, H]
            grad_x = ops.unpermute(grad_rows, slot_to_row, None, top_k)
        return grad_x, grad_weights, grad_w1, grad_b1, grad_w2, grad_b2


def whole_experts(activation_name: str) -> WholeExperts:
    """The whole-layer computation for an activation: Triton's activation kernels when they implement it."""
    if activation_name in ACTIVATIONS:
        return WholeExperts(torch.ops.hf_moe_triton.expert_act, torch.ops.hf_moe_triton.expert_act_backward)
    return WholeExperts(torch_expert_act, torch_expert_act_backward)


# The whole-layer computation as two ops with the compiled CPU ops' schemas, the forward differentiable by itself
# (autograd.register_experts): `run_experts` calls it directly, and torch.export keeps it as one node.
@torch.library.custom_op(_NS + "moe_experts_forward", mutates_args=())
def moe_experts_forward(
    hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor,
    b2: Optional[Tensor], activation: str, glu: bool, save_h: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    out, h, *plan = whole_experts(activation).forward(
        hidden_states, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu, save_h
    )
    return (out, h if save_h else h.new_empty(0, h.shape[1]), *plan)


@torch.library.custom_op(_NS + "moe_experts_backward", mutates_args=())
def moe_experts_backward(
    grad_out: Tensor, x: Tensor, h: Tensor, sorted_slots: Tensor, slot_to_row: Tensor, tokens_per_expert: Tensor,
    row_weight: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: str,
    glu: bool, need_x: bool, need_weights: bool, need_params: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = whole_experts(activation).backward(
        grad_out, x, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight, w1, b1, w2, b2, activation, glu,
        need_x, need_weights, need_params,
    )
    return tuple(g.clone() if g.numel() == 0 else g for g in grads)  # custom ops return no output twice


moe_experts_forward.register_fake(whole_forward_fake)
moe_experts_backward.register_fake(whole_backward_fake)
register_experts(_NS + "moe_experts_forward", moe_experts_backward)
