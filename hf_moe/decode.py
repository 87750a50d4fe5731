"""hf_moe's fused decode step: one token of a model with Llama's decoder layer, over a static KV cache, compiled once
into one program.

transformers' decode step calls, per layer, a norm, three projections, the rotary embedding, the cache update,
attention, the o projection, the residual add and another norm before the MLP: a dozen kernels, each a dispatch and a
parallel region, most of them on a few hundred numbers. The fused step runs that whole attention sub-block as one
op, `hf_moe::decode_attention_block` (csrc/cpu/decode_cpu.cpp; reference in hf_moe/ops/decode.py), and leaves the
rest to the model's own modules: the embedding, the rotary embedding's cos/sin, the MLP (an hf_moe MoE block, whose
experts run `hf_moe::moe_experts_infer`, or a dense MLP), the final norm and the LM head (`hf_moe::linear_infer`
when it is int8 or a decode-sized product). The step is compiled with `torch.compile(fullgraph=True, dynamic=False)`
(and the inductor options of `hf_moe.generation.DECODE_OPTIONS`), so no Python runs between its kernels.

Where every layer is one its kernels compute with nothing around them (an hf_moe MoE block with the plain top-k
router: `hf_moe.decode_native.native_unsupported`), the step is not compiled at all: it is one call of
`hf_moe::decode_step`, which runs the same kernels layer by layer in C++ (hf_moe/decode_native.py; 1.1x the compiled
step's speed on the quickstart's model, and no compilation on the first call).

It is what `MoEForCausalLM.generate` runs for each decoded token when a static cache is asked for
(`cache_implementation="static"`, see hf_moe.generation), where the model allows it (`unsupported`): CPU, fp32 or
bf16, the compiled extension loaded, and decoder layers of a family that shares Llama's (LlamaDecoderLayer,
MistralDecoderLayer, Qwen2DecoderLayer, Qwen3DecoderLayer without sliding windows) over an RMSNorm'd backbone. Any
other call (a prompt, outputs of attentions or hidden states, another cache) runs transformers' compiled forward,
as it would without hf_moe. The greedy tokens are the eager model's (tests/test_decode.py): the fused op rounds
every intermediate the eager bf16 model rounds, where it rounds it.
"""

from __future__ import annotations

import torch
from torch import nn

from .compat import CACHE_NAME, skipping_guards, static_cache_layers
from .decode_native import NativeDecodeStep, native_unsupported
from .huge_pages import back_with_huge_pages
from .layers.quantized_linear import QuantizedLinear, linear_weights
from .ops import backend_setting, load_extension

# Decoder layers (and their attention) computing what LlamaDecoderLayer computes: pre-norm attention with rotary
# embeddings (Qwen3: and a per-head RMSNorm of q and k), pre-norm MLP, residual adds.
LAYERS = {
    "LlamaDecoderLayer": "LlamaAttention", "MistralDecoderLayer": "MistralAttention",
    "Qwen2DecoderLayer": "Qwen2Attention", "Qwen3DecoderLayer": "Qwen3Attention",
}
BACKBONES = {"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"}  # their MoE subclasses: MoELlamaModel, ...
NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


def _is_norm(module) -> bool:
    return type(module).__name__ in NORMS and isinstance(getattr(module, "weight", None), torch.Tensor)


def _is_projection(module) -> bool:
    return isinstance(module, (nn.Linear, QuantizedLinear))


def unsupported(model) -> str | None:
    """Why the fused decode step cannot run `model` (None: it can)."""
    backbone = getattr(model, "model", None)
    if backbone is None or not any(c.__name__ in BACKBONES for c in type(backbone).__mro__):
        return f"its backbone ({type(backbone).__name__}) is not one of {', '.join(sorted(BACKBONES))}"
    lm_head = getattr(model, "lm_head", None)
    if not _is_projection(lm_head) or not isinstance(getattr(backbone, "embed_tokens", None), nn.Embedding):
        return "it has no nn.Embedding input embedding and linear LM head"
    if not _is_norm(getattr(backbone, "norm", None)) or getattr(backbone, "rotary_emb", None) is None:
        return "its backbone has no RMSNorm final norm and rotary embedding"
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.bfloat16):
        return f"it is {param.dtype} on {param.device.type} (the fused step runs fp32 and bf16 on CPU)"
    if getattr(model, "hf_device_map", None) is not None:
        return "accelerate placed it (device_map)"
    config = model.config
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "it attends within a sliding window"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "some of its layers are not full-attention layers"
    for i, layer in enumerate(backbone.layers):
        attention = getattr(layer, "self_attn", None)
        if LAYERS.get(type(layer).__name__) != type(attention).__name__:
            return f"layer {i} is a {type(layer).__name__}, not one of {', '.join(sorted(LAYERS))}"
        if not all(_is_projection(getattr(attention, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"layer {i}'s attention projections are not linear layers"
        if not (_is_norm(getattr(layer, "input_layernorm", None))
                and _is_norm(getattr(layer, "post_attention_layernorm", None))):
            return f"layer {i}'s norms are not RMSNorms"
        if getattr(attention, "sliding_window", None) is not None:
            return f"layer {i} attends within a sliding window"
        has_qk_norm = hasattr(attention, "q_norm") or hasattr(attention, "k_norm")
        if has_qk_norm and not (_is_norm(getattr(attention, "q_norm", None))
                                and _is_norm(getattr(attention, "k_norm", None))):
            return f"layer {i}'s q/k norms are not RMSNorms"
        if param.dtype != layer.input_layernorm.weight.dtype:
            return "its weights are not all of one dtype"
    if backend_setting() == "torch" or load_extension()[0] is None:
        return "the compiled extension is not loaded (`python -m hf_moe.env` says why)"
    return None


def _full_attention_mask(mask):
    """The bool [B, L] mask of a decode step (transformers passes [B, 1, 1, L], or a dict of them by layer type),
    or False when the step's mask is something else (the fused step then does not run)."""
    if isinstance(mask, dict):
        if set(mask) != {"full_attention"}:
            return False
        mask = mask["full_attention"]
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1):
        return False
    return mask[:, 0, 0, :]


def _decode_linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """[N, K] -> [N, O] of an nn.Linear or QuantizedLinear: the decode kernel (`hf_moe::linear_infer`)."""
    weight, scale, bias = linear_weights(module)
    return torch.ops.hf_moe.linear_infer(x, weight, scale, bias)


class FusedDecodeStep:
    """The decode step of `model` (a callable taking `forward`'s keyword arguments), fused where the call is one
    token on an initialised static cache, and `fallback()`'s call (transformers' compiled forward) otherwise. With
    `native` (the default), a fused call of a model `hf_moe.decode_native` serves is one op call instead of the
    compiled program (`NativeDecodeStep`, made again at each `generate` call). With `huge_pages` (the default), each
    call's first fused step asks for the model's weights on transparent huge pages (`_prepare`).

    Compiled on the first call (`torch.compile(fullgraph=True, dynamic=False, options=options)`), once per batch
    size and cache length, as transformers' own compiled step.

    With `skip_guards`, Dynamo's guards (a check of every module attribute and weight the step reads, a few thousand
    of them) are evaluated on the first step of each `generate` call, which may recompile; the later steps of the
    call, on the same cache and shapes, skip them (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)` around
    the call alone, in the caller's stance). They cost 1.9 ms of a 20 ms step of the quickstart's model
    (docs/serving-cpu.md). Nothing that the guards check changes between two steps of one call;
    `MoEForCausalLM.generate` calls `reset` first, so a model changed between calls (quantized, its modules
    replaced) is checked, and compiled for again."""

    def __init__(self, model, options: dict | None, fallback, skip_guards: bool = True, native: bool = True,
                 huge_pages: bool = True):
        self.model = model
        self.fallback = fallback
        self.skip_guards = skip_guards
        self.compiled = torch.compile(self.forward, fullgraph=True, dynamic=False, options=options or None)
        self.trusted = None  # the (cache, shapes) whose step passed every guard in this generate call; None: none
        self.native_allowed, self.huge_pages = native, huge_pages
        self.native: NativeDecodeStep | None | bool = False  # False: not yet decided for this generate call
        self.huge_page_bytes = 0  # of the model's weights the kernel put on huge pages at the last call's start

    def reset(self) -> None:
        """A `generate` call begins or ends: the next call's first step evaluates every guard again, and the one-op
        step (`hf_moe.decode_native`) is dropped, with its references to the weights, and made again from the model
        as it is then."""
        self.trusted = None
        self.native = False

    def _prepare(self) -> NativeDecodeStep | None:
        """At the first fused call of each `generate` call: the model's weights asked onto transparent huge pages
        (`hf_moe.huge_pages`: the step streams them; the first time about a second per GiB, milliseconds after),
        and the one-op step of the model as it is now, returned, or None where `native_unsupported` says why not."""
        if self.native is False:
            if self.huge_pages:
                self.huge_page_bytes = back_with_huge_pages([*self.model.parameters(), *self.model.buffers()])
            self.native = (NativeDecodeStep(self.model) if self.native_allowed
                           and native_unsupported(self.model) is None else None)
        return self.native

    def handles(self, kwargs: dict, layers: list | None) -> bool:
        """Whether the call (forward's keyword arguments; `layers`: `static_cache_layers` of its cache) is one the
        fused step computes: one token per row on an initialised static cache, nothing but logits asked for."""
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        extra = {"input_ids", CACHE_NAME, "position_ids", "attention_mask", "logits_to_keep", "use_cache",
                 "return_dict"}
        flags = ("output_attentions", "output_hidden_states", "output_router_logits")
        return (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 1
                and isinstance(positions, torch.Tensor) and positions.shape == ids.shape
                and layers is not None and len(layers) == len(self.model.model.layers)
                and layers[0][0].shape[0] == ids.shape[0]
                and _full_attention_mask(kwargs.get("attention_mask")) is not False
                and kwargs.get("logits_to_keep", 0) in (0, 1)
                and all(not kwargs.get(f) for f in flags) and set(kwargs) - set(flags) <= extra
                and not torch.is_grad_enabled())

    def __call__(self, **kwargs):
        layers = static_cache_layers(kwargs.get(CACHE_NAME))
        if not self.handles(kwargs, layers):
            self.trusted = None
            return self.fallback()(**kwargs)
        mask = _full_attention_mask(kwargs.get("attention_mask"))
        args = (kwargs["input_ids"], kwargs["position_ids"], mask, layers)
        native = self._prepare()
        if native is not None and native.runs(args[0].shape[0]):  # the whole step in one op, nothing compiled
            return self.model.output_class(logits=native(*args), **{CACHE_NAME: kwargs[CACHE_NAME]})
        key = (id(layers[0][0]), len(layers), tuple(kwargs["input_ids"].shape), None if mask is None else mask.shape)
        if self.skip_guards and key == self.trusted:  # a later step of this call, on its first step's cache
            with skipping_guards():
                logits = self.compiled(*args)
        else:
            logits = self.compiled(*args)
            self.trusted = key
        return self.model.output_class(logits=logits, **{CACHE_NAME: kwargs[CACHE_NAME]})

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, cache: list):
        """input_ids [B, 1], position_ids [B, 1], mask [B, L] bool or None, cache `static_cache_layers`'s list ->
        logits [B, 1, V]; k and v written into the cache at each layer's length, which grows by one."""
        backbone = self.model.model
        hidden = backbone.embed_tokens(input_ids[:, 0])  # [B, H]
        cos, sin = backbone.rotary_emb(hidden[:, None], position_ids)  # [B, 1, D] each
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        for layer, (keys, values, length) in zip(backbone.layers, cache):
            attention = layer.self_attn
            q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
            hidden, x = torch.ops.hf_moe.decode_attention_block(
                hidden, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                *linear_weights(attention.q_proj), *linear_weights(attention.k_proj),
                *linear_weights(attention.v_proj), *linear_weights(attention.o_proj),
                None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                1e-6 if q_norm is None else q_norm.variance_epsilon, cos, sin, keys, values, length, mask,
                attention.scaling, layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.variance_epsilon,
            )
            length.add_(1)
            hidden = hidden + layer.mlp(x)
        hidden = backbone.norm(hidden)
        return _decode_linear(hidden, self.model.lm_head)[:, None]  # [B, 1, V]


def fused_decode_step(model, options: dict | None, fallback, skip_guards: bool = True, native: bool = True,
                      huge_pages: bool = True) -> FusedDecodeStep | None:
    """The fused step of `model`, or None where `unsupported(model)` says why not."""
    if unsupported(model) is not None:
        return None
    return FusedDecodeStep(model, options, fallback, skip_guards, native, huge_pages)


def decode_step(model, config, fallback) -> FusedDecodeStep | None:
    """`fused_decode_step` of `model` for a compile config (`hf_moe.generation.DecodeCompileConfig`), made once per
    config and kept on the model (`_hf_moe_decode_steps`: (config, step) pairs, so one compilation per config)."""
    steps = model.__dict__.setdefault("_hf_moe_decode_steps", [])
    step = next((step for known, step in steps if known == config), False)
    if step is False:
        step = fused_decode_step(model, config.options, fallback, getattr(config, "skip_guards", True),
                                 getattr(config, "native", True), getattr(config, "huge_pages", True))
        steps.append((config, step))
    return step


def reset_decode_steps(model) -> None:
    """`FusedDecodeStep.reset` of every step made for `model` (a new `generate` call)."""
    for _, step in model.__dict__.get("_hf_moe_decode_steps", []):
        if step is not None:
            step.reset()
