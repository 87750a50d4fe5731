"""Every hf_moe op, defined when hf_moe is imported, so a saved `torch.export` program (.pt2) that calls them loads
and runs in any process that has done `import hf_moe`, whichever backend traced it.

    hf_moe::         the dispatch ops and the whole-layer expert computation (the compiled backend's). Their schemas
                     are defined here; their default kernel, on every device, is the pure-torch one (reference.py,
                     experts.reference_forward / reference_backward); the C++ extension (csrc/) registers CPU
                     kernels for them when it loads. Nothing is compiled at import: a call on CPU tensors that
                     reaches a default kernel first loads the extension (building it once, as a model's first call
                     would; never under HF_MOE_BACKEND=torch) and then runs its kernel, or the pure-torch one when
                     the extension cannot be built.
                     The decode step's ops (linear_infer, decode_attention_block) are defined the same way,
                     from decode.py.
    hf_moe_torch::   the pure-torch loops over row groups (reference.py, defined when it is imported)
    hf_moe_triton::  the Triton ops (triton/ops.py: defined without importing triton, which runs when an op does)

Each op has a fake kernel (its shapes, for `torch.compile` and `torch.export`), where it can appear in a forward, a
backward formula of its own (autograd.py), and a decomposition into standard ATen ops, which `torch.onnx.export`
applies to a program that holds it (decompositions.py).
"""

from __future__ import annotations

import threading

import torch

from .reference import (
    expert_act, expert_act_backward, grouped_mm, grouped_mm_weight_grad, permute, sort_by_expert, unpermute,
)
from .autograd import register_composable, register_experts
from . import decode
from .decompositions import register as register_decompositions
from .experts import reference_backward, reference_forward, whole_backward_fake, whole_forward_fake
from .extension import backend_setting, load_extension
from .infer import infer_fake
from .int8 import compute_weights
from .triton import ops as triton_ops  # noqa: F401  (defines the hf_moe_triton ops)

NAMESPACE = "hf_moe"
SCHEMAS = {
    "sort_by_expert": "(Tensor top_k_index, int num_experts) -> (Tensor, Tensor, Tensor)",
    "permute": "(Tensor hidden_states, Tensor sorted_slots, int top_k) -> Tensor",
    "unpermute": "(Tensor rows, Tensor slot_to_row, Tensor? top_k_weights, int top_k) -> Tensor",
    "grouped_mm": "(Tensor x, Tensor weight, Tensor tokens_per_expert, Tensor? bias, Tensor? bias_scale, "
                  "bool transpose_weight) -> Tensor",
    "grouped_mm_weight_grad": "(Tensor grad_out, Tensor x, Tensor tokens_per_expert) -> Tensor",
    "expert_act": "(Tensor h, Tensor? row_scale, str activation, bool glu) -> Tensor",
    "expert_act_backward": "(Tensor grad, Tensor h, Tensor? row_scale, str activation, bool glu, "
                           "bool return_output) -> (Tensor, Tensor, Tensor)",
    # The whole expert computation in one call: (out, h, sorted_slots, slot_to_row, tokens_per_expert, row_weight);
    # h is [0, W] unless save_h.
    "moe_experts_forward": "(Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, Tensor w1, Tensor? b1, "
                           "Tensor w2, Tensor? b2, str activation, bool glu, bool save_h) -> "
                           "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    # (grad_x, grad_top_k_weights, grad_w1, grad_b1, grad_w2, grad_b2); [0] where not asked for or no bias.
    "moe_experts_backward": "(Tensor grad_out, Tensor hidden_states, Tensor h, Tensor sorted_slots, "
                            "Tensor slot_to_row, Tensor tokens_per_expert, Tensor row_weight, Tensor w1, Tensor? b1, "
                            "Tensor w2, Tensor? b2, str activation, bool glu, bool need_x, bool need_weights, "
                            "bool need_params) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    # Inference only (infer.py; its CPU kernel is csrc/cpu/infer_cpu.cpp): w1 [E, W, H], w2 [E, H, I] fp32, bf16 or
    # int8 with fp32 scales [E, out] or [E, out, groups]; returns [N, H]. kernels: "auto", "avx2" or "portable" (tests).
    "moe_experts_infer": "(Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, Tensor w1, "
                         "Tensor? w1_scale, Tensor? b1, Tensor w2, Tensor? w2_scale, Tensor? b2, str activation, "
                         "bool glu, str kernels=\"auto\") -> Tensor",
}


def reference_infer(x, top_k_index, top_k_weights, w1, w1_scale, b1, w2, w2_scale, b2, activation, glu,
                    kernels="auto"):
    """`hf_moe::moe_experts_infer` in pure torch: int8 weights dequantized to the activations' dtype (the kernel's
    reference, int8.py), then `moe_experts_forward`'s reference. [N, H] -> [N, H]."""
    w1, b1, w2, b2 = compute_weights(x.dtype, w1, w1_scale, b1, w2, w2_scale, b2)
    return reference_forward(x, top_k_index, top_k_weights, w1, b1, w2, b2, activation, glu, False)[0]


TORCH_KERNELS = {
    "sort_by_expert": sort_by_expert,
    "permute": permute,
    "unpermute": unpermute,
    "grouped_mm": grouped_mm,
    "grouped_mm_weight_grad": grouped_mm_weight_grad,
    "expert_act": expert_act,
    "expert_act_backward": expert_act_backward,
    "moe_experts_forward": reference_forward,
    "moe_experts_backward": reference_backward,
    "moe_experts_infer": reference_infer,
    **decode.TORCH_KERNELS,
}

# A FRAGMENT, so the C++ extension's registrations (TORCH_LIBRARY_IMPL, csrc/) add to it in any order.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_redispatching = threading.local()


def _on_cpu(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args)


def _default_kernel(name: str):
    torch_kernel = TORCH_KERNELS[name]

    def kernel(*args):
        """The compiled CPU kernel once the extension is loaded (loading it on the way), else pure torch."""
        if _on_cpu(args) and backend_setting() != "torch" and not getattr(_redispatching, "active", False):
            module, _ = load_extension()  # cached; warns once (or raises under HF_MOE_BACKEND=compiled)
            if module is not None:  # its CPU kernel is registered now: dispatch again, once
                _redispatching.active = True
                try:
                    return getattr(torch.ops.hf_moe, name)(*args)
                finally:
                    _redispatching.active = False
        return torch_kernel(*args)

    kernel.__name__ = f"{name}_default"
    return kernel


def _register_fake_kernels() -> None:
    """Shape functions of the hf_moe ops, so `torch.compile` and `torch.export` trace through them."""
    lib = NAMESPACE + "::"

    @torch.library.register_fake(lib + "sort_by_expert", lib=_LIB)
    def _(top_k_index, num_experts):
        m = top_k_index.numel()
        new = top_k_index.new_empty
        return new(m, dtype=torch.int64), new(m, dtype=torch.int64), new(num_experts, dtype=torch.int64)

    @torch.library.register_fake(lib + "permute", lib=_LIB)
    def _(hidden_states, sorted_slots, top_k):
        return hidden_states.new_empty(sorted_slots.shape[0], hidden_states.shape[1])

    @torch.library.register_fake(lib + "unpermute", lib=_LIB)
    def _(rows, slot_to_row, top_k_weights, top_k):
        return rows.new_empty(slot_to_row.shape[0] // top_k, rows.shape[1])

    @torch.library.register_fake(lib + "grouped_mm", lib=_LIB)
    def _(x, weight, tokens_per_expert, bias, bias_scale, transpose_weight):
        return x.new_empty(x.shape[0], weight.shape[1] if transpose_weight else weight.shape[2])

    @torch.library.register_fake(lib + "grouped_mm_weight_grad", lib=_LIB)
    def _(grad_out, x, tokens_per_expert):
        return x.new_empty(tokens_per_expert.shape[0], grad_out.shape[1], x.shape[1])

    @torch.library.register_fake(lib + "expert_act", lib=_LIB)
    def _(h, row_scale, activation, glu):
        return h.new_empty(h.shape[0], h.shape[1] // 2 if glu else h.shape[1])

    @torch.library.register_fake(lib + "expert_act_backward", lib=_LIB)
    def _(grad, h, row_scale, activation, glu, return_output):
        scale_dtype = (row_scale if row_scale is not None else h).dtype
        scale = h.new_empty(h.shape[0] if row_scale is not None else 0, dtype=scale_dtype)
        return torch.empty_like(h), scale, h.new_empty(h.shape[0] if return_output else 0, grad.shape[1])

    torch.library.register_fake(lib + "moe_experts_forward", whole_forward_fake, lib=_LIB)
    torch.library.register_fake(lib + "moe_experts_backward", whole_backward_fake, lib=_LIB)
    torch.library.register_fake(lib + "moe_experts_infer", infer_fake, lib=_LIB)
    for name, fake in decode.FAKE_KERNELS.items():
        torch.library.register_fake(lib + name, fake, lib=_LIB)


SCHEMAS.update(decode.SCHEMAS)  # the decode step's ops (inference only; decode.py)
for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _default_kernel(_name), "CompositeExplicitAutograd")
_register_fake_kernels()
register_experts(f"{NAMESPACE}::moe_experts_forward", torch.ops.hf_moe.moe_experts_backward)
register_composable(NAMESPACE)
for _namespace in (NAMESPACE, "hf_moe_torch", "hf_moe_triton"):  # what every exporter translates (decompositions.py)
    register_decompositions(_namespace)
