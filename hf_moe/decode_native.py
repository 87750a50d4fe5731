"""The whole decode step in one call: `hf_moe::decode_step` (csrc/cpu/decode_step_cpu.cpp), for the models whose
every layer the fused step's kernels compute with nothing around them.

`hf_moe.decode.FusedDecodeStep` compiles its step with inductor's C++ wrapper: the program still runs, per layer, a
dozen small kernels, allocations and dispatcher calls between the attention sub-block and the experts (the router's
cast, GEMM, softmax, top-k, weights and the residual add), and the call itself goes through Dynamo. On the quickstart's
model that was a sixth of a 22 ms step, on the main thread alone, while the other thread waited (perf, docs/serving-
cpu.md). `NativeDecodeStep` calls one op instead, which runs the same kernels layer by layer in C++, and needs no
compilation (the compiled step's first call took 80 to 100 s with inductor's cache cold). Interleaved with the
compiled step in one process, it took 0.90x its time in bf16 and 0.84x in int8 (docs/serving-cpu.md).

It runs where `native_unsupported(model)` is None: what `hf_moe.decode.unsupported` allows, and besides

  * every decoder layer's MLP an hf_moe `SparseMoeBlock` with the plain `topk` router (softmax, top-k, optionally
    renormalised; no dynamic skipping, capacity or unit weights), no shared experts and no output bias, and experts
    the compiled kernel computes as the eager model does (fp32 or bf16 on an AVX-512 BF16 CPU, or int8), all
    layers with one top-k, renormalisation, activation and GLU;
  * a rotary embedding whose values depend on the position alone (rope types default, linear, llama3, yarn): its
    values for every position of the cache are computed once per cache, by the model's own module.

`runs(batch)` adds what depends on the call: no routing being recorded, and (bf16 experts) a batch the experts'
kernel takes in eager mode too (`hf_moe.ops.infer.MAX_TOKENS`). Everywhere else the fused step runs its compiled
program, as before. The router calls ATen's own kernels, as the eager router does, and every other kernel is the
compiled step's, so the scores differ from the eager model's by the same bf16 roundings as the compiled step's; the
tests (tests/test_decode_native.py) check the eager greedy tokens, where a near-tie of bf16 logits could go either
way for either step.
"""

from __future__ import annotations

import torch

from .layers.block import SparseMoeBlock
from .layers.experts import Experts
from .layers.quantized import QuantizedExperts
from .layers.quantized_linear import linear_weights
from .layers.router import TopKRouter
from .ops import backend_setting, infer, load_extension, reference
from .ops.backend import _activation_of, expert_weights, kernel_activation

# Rope types whose cos/sin depend on the position alone (transformers' dynamic and longrope types change with the
# sequence's length).
ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
SLOTS = 23  # tensors per layer in the op's `layers` (csrc/cpu/decode_step_cpu.cpp, enum Slot)


def _experts_args(experts, dtype: torch.dtype) -> tuple | None:
    """(w1, w1_scale, b1, w2, w2_scale, b2, activation, glu) as the eager experts pass them to
    `hf_moe::moe_experts_infer` for activations of `dtype`, or None where the eager experts would run another
    kernel."""
    if type(experts) is QuantizedExperts:
        return experts.kernel_args(dtype)
    if type(experts) is not Experts or experts.num_local_experts != experts.num_experts:
        return None
    w1, b1, w2, b2 = expert_weights(experts)
    if w1.dtype not in infer.MAX_TOKENS or infer.kernel_isa() != "avx512_bf16":
        return None
    return w1, None, b1, w2, None, b2, kernel_activation(_activation_of(experts)), experts.has_gate


def _block_reason(i: int, block, args: tuple | None) -> str | None:
    """Why layer i's MLP `block` (its experts' `_experts_args`: `args`) is not one the op computes, or None."""
    if type(block) is not SparseMoeBlock:
        return f"layer {i}'s MLP is a {type(block).__name__}, not an hf_moe SparseMoeBlock"
    gate = block.gate
    if type(gate) is not TopKRouter or gate.skip_threshold or gate.unit_weights or gate.capacity(1) is not None:
        return f"layer {i}'s router is not a plain top-k router ({gate.extra_repr()})"
    if block.shared_experts is not None or block.bias is not None or (block.dropout is not None and block.training):
        return f"layer {i}'s MoE block has shared experts, an output bias or dropout"
    if args is None or args[6] not in reference.KERNEL_ACTIVATIONS:
        return f"layer {i}'s experts ({type(block.experts).__name__}) do not run the compiled inference kernel"
    return None


def native_unsupported(model) -> str | None:
    """Why `hf_moe::decode_step` cannot run `model`'s decode step (None: it can), beyond `hf_moe.decode.unsupported`
    (which the caller checks first)."""
    if backend_setting() == "torch" or load_extension()[0] is None:
        return "the compiled extension is not loaded (`python -m hf_moe.env` says why)"
    backbone = model.model
    if getattr(backbone.rotary_emb, "rope_type", None) not in ROPE_TYPES:
        return f"its rotary embedding ({getattr(backbone.rotary_emb, 'rope_type', None)}) is not one of {ROPE_TYPES}"
    shared, dtype = set(), backbone.embed_tokens.weight.dtype
    for i, layer in enumerate(backbone.layers):
        args = _experts_args(getattr(layer.mlp, "experts", None), dtype)
        reason = _block_reason(i, layer.mlp, args)
        if reason is not None:
            return reason
        gate = layer.mlp.gate
        shared.add((gate.top_k, bool(gate.norm_topk_prob), args[6], args[7]))
    if len(shared) != 1:
        return "its layers differ in top-k, renormalisation, activation or GLU"
    return None


class NativeDecodeStep:
    """`hf_moe::decode_step`'s arguments for `model` (made once; `native_unsupported(model)` must be None), and the
    call. Rebuilt by the fused step at each `generate` call, so a model changed between calls is read again."""

    def __init__(self, model):
        self.model = model
        backbone = model.model
        self.dtype = backbone.embed_tokens.weight.dtype
        self.layers: list[torch.Tensor | None] = []
        self.floats: list[float] = []
        for layer in backbone.layers:
            attention, block = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
            w1, s1, b1, w2, s2, b2, self.activation, self.glu = _experts_args(block.experts, self.dtype)
            self.layers += [
                layer.input_layernorm.weight, *linear_weights(attention.q_proj), *linear_weights(attention.k_proj),
                *linear_weights(attention.v_proj), *linear_weights(attention.o_proj),
                None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                layer.post_attention_layernorm.weight, block.gate.weight.float(), w1.contiguous(), s1, b1,
                w2.contiguous(), s2, b2,
            ]
            self.floats += [layer.input_layernorm.variance_epsilon,
                            1e-6 if q_norm is None else q_norm.variance_epsilon, attention.scaling,
                            layer.post_attention_layernorm.variance_epsilon]
            self.top_k, self.norm_topk_prob = block.gate.top_k, bool(block.gate.norm_topk_prob)
        assert len(self.layers) == SLOTS * len(backbone.layers)
        # The batch the experts' kernel takes in eager mode too: any rows for int8 experts, MAX_TOKENS otherwise.
        int8 = all(type(layer.mlp.experts) is QuantizedExperts for layer in backbone.layers)
        self.max_batch = None if int8 else infer.MAX_TOKENS[self.dtype]
        self.recorder = backbone.layers[0].mlp.router_recorder
        self.rotary = None  # (cache length, cos [L, D], sin [L, D])

    def runs(self, batch: int) -> bool:
        """Whether a decode call of `batch` rows runs here: no routing recorded, and a batch the eager experts'
        compiled kernel takes (bf16 experts: `infer.MAX_TOKENS`)."""
        if self.recorder is not None and self.recorder.outputs is not None:
            return False
        return self.max_batch is None or batch <= self.max_batch

    def _rotary(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, D] of positions 0 .. length - 1, from the model's rotary module (what it gives for
        each position alone: each value is one product and its cos or sin)."""
        if self.rotary is None or self.rotary[0] != length:
            backbone = self.model.model
            positions = torch.arange(length, device=backbone.embed_tokens.weight.device)[None]
            probe = torch.empty(1, length, 1, dtype=self.dtype)
            cos, sin = backbone.rotary_emb(probe, positions)  # [1, L, D] each
            self.rotary = (length, cos[0].contiguous(), sin[0].contiguous())
        return self.rotary[1], self.rotary[2]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 cache: list) -> torch.Tensor:
        """input_ids [B, 1], position_ids [B, 1], mask [B, L] bool or None, cache `static_cache_layers`'s list ->
        logits [B, 1, V] (as `FusedDecodeStep.forward`)."""
        backbone, head = self.model.model, self.model.lm_head
        keys, values, lengths = zip(*cache)
        cos, sin = self._rotary(keys[0].shape[2])
        norm = backbone.norm
        return torch.ops.hf_moe.decode_step(
            input_ids, position_ids, mask, backbone.embed_tokens.weight, cos, sin, self.layers, self.floats,
            list(keys), list(values), list(lengths), norm.weight, norm.variance_epsilon, *linear_weights(head),
            self.top_k, self.norm_topk_prob, self.activation, self.glu,
        )
