"""hf_moe's decode step: one token of a model with Llama's decoder layer, over a static KV cache, either one call of
the model's plan (the one-op step) or the attention-block step, compiled once into one program.

transformers' decode step calls, per layer, a norm, three projections, the rotary embedding, the cache update,
attention, the o projection, the residual add and another norm before the MLP: a dozen kernels, each a dispatch and
a parallel region, most of them on a few hundred numbers. The attention-block step runs that whole attention
sub-block as one op, `hf_moe::decode_attention_block` (csrc/cpu/decode_cpu.cpp; reference in hf_moe/ops/decode.py),
and leaves the rest to the model's own modules: the embedding, the rotary embedding's cos/sin, the MLP (an hf_moe
MoE block, whose experts run `hf_moe::moe_experts_infer`, or a dense MLP), the final norm and the LM head
(`hf_moe::linear_infer` when it is int8 or a decode-sized product). The step is compiled with
`torch.compile(fullgraph=True, dynamic=False)` (and the inductor options of `hf_moe.generation.DECODE_OPTIONS`), so
no Python runs between its kernels.

Where every layer is one its kernels compute with nothing around them (an hf_moe MoE block with the plain top-k
router, one of transformers' own MoE blocks, a dense MLP: `hf_moe.decode_one_op.one_op_reason`), the step is not
compiled at all: it is one call of the model's plan (`hf_moe.decode_one_op.DecodePlan`), which runs the same kernels
layer by layer in C++ (faster than the attention-block step on the quickstart's model, docs/serving-cpu.md, and no
compilation on the first call). transformers' own Mixtral, Qwen2-MoE and Qwen3-MoE run it through
`hf_moe.generate(model, ...)` (hf_moe.generation), their `generate` being transformers' own.

Which engine decodes a model is decided in one place, `choose_decode`, which gives its reason too:

  one_op    the plan's step (hf_moe.decode_one_op): `generate`'s default on CPU wherever it serves the model, and what
            a static cache gets there too;
  attention_block
            the compiled attention-block step (a static cache asked for, the one-op step not serving the model,
            or `decode_compile_config(one_op=False)`); its former name, `fused`, still compares equal, with a
            DeprecationWarning, for one release;
  compiled  transformers' compiled forward (a static cache, and a model whose layers the attention-block step does
            not cover, or a `compile_config` of the caller's own);
  eager     the model's forward, nothing compiled (the default wherever the one-op step does not serve the model:
            no minute-long first call a user did not ask for).

The attention-block step needs CPU, fp32 or bf16, the compiled extension loaded, and decoder layers of a family that
shares Llama's (LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer, Qwen3DecoderLayer without sliding
windows) over an RMSNorm'd backbone. Any call that is not one decode token (a prompt, outputs of attentions or
hidden states, another cache) runs the fallback (transformers' compiled forward, or the model's forward where
nothing is compiled), as it would without hf_moe. The greedy tokens are the eager model's (tests/test_decode.py):
the attention-block op rounds every intermediate the eager bf16 model rounds, where it rounds it.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .compat import CACHE_NAME, skipping_guards, static_cache_layers
from .decode_one_op import DecodePlan, max_batch, moe_layers, one_op_reason, plan_for
from .huge_pages import back_with_huge_pages
from .layers.quantized_linear import QuantizedLinear, linear_weights
from .ops import backend_setting, load_extension

# Decoder layers (and their attention) computing what LlamaDecoderLayer computes: pre-norm attention with rotary
# embeddings (Qwen3, Qwen3-MoE: and a per-head RMSNorm of q and k), pre-norm MLP, residual adds; the last four are
# transformers' MoE families (served by the one-op step only: the attention-block step is hf_moe models')
LAYERS = {
    "LlamaDecoderLayer": "LlamaAttention", "MistralDecoderLayer": "MistralAttention",
    "Qwen2DecoderLayer": "Qwen2Attention", "Qwen3DecoderLayer": "Qwen3Attention",
    "MixtralDecoderLayer": "MixtralAttention", "Qwen2MoeDecoderLayer": "Qwen2MoeAttention",
    "Qwen3MoeDecoderLayer": "Qwen3MoeAttention", "OlmoeDecoderLayer": "OlmoeAttention",
}
# their MoE subclasses too: MoELlamaModel, ...
BACKBONES = {"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model", "MixtralModel", "Qwen2MoeModel",
             "Qwen3MoeModel", "OlmoeModel"}
NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MixtralRMSNorm", "Qwen2MoeRMSNorm",
         "Qwen3MoeRMSNorm", "OlmoeRMSNorm"}
ONE_OP, ATTENTION_BLOCK, COMPILED, EAGER = "one_op", "attention_block", "compiled", "eager"  # (module docstring)
FORMER_ENGINES = {"fused": ATTENTION_BLOCK}  # deprecated engine name -> its name now (equal for one release)
logger = logging.getLogger("hf_moe")


class Engine(str):
    """An engine's name (a str), which for one release also equals its former name (`FORMER_ENGINES`), warning."""

    def __eq__(self, other) -> bool:
        if isinstance(other, str) and FORMER_ENGINES.get(str(other)) == str(self) and str(other) != str(self):
            warnings.warn(f"the decode engine {other!r} is now called {str(self)!r}; {other!r} is deprecated",
                          DeprecationWarning, stacklevel=2)
            return True
        return str.__eq__(self, other)

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__


def __getattr__(name: str):
    """The former public names (the attention-block step was "fused", a word kept for stacked expert weights)."""
    former = {"FUSED": "ATTENTION_BLOCK", "FusedDecodeStep": "DecodeStep"}
    if name in former:
        warnings.warn(f"hf_moe.decode.{name} is deprecated: use {former[name]}", DeprecationWarning, stacklevel=2)
        return globals()[former[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_norm(module) -> bool:
    return type(module).__name__ in NORMS and isinstance(getattr(module, "weight", None), torch.Tensor)


def _is_projection(module) -> bool:
    return isinstance(module, (nn.Linear, QuantizedLinear))


def _attention_block_reason(model) -> str | None:
    """Why the attention-block step cannot run `model` (None: it can)."""
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
        return f"it is {param.dtype} on {param.device.type} (the attention-block step runs fp32 and bf16 on CPU)"
    if getattr(model, "hf_device_map", None) is not None:
        return "accelerate placed it (device_map)"
    config = model.config
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "it attends within a sliding window"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "some of its layers are not full-attention layers"
    if getattr(config, "clip_qkv", None) is not None:
        return "it clips q, k and v (clip_qkv), which the attention kernel does not"
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
        if has_qk_norm and attention.q_norm.weight.numel() != attention.head_dim:
            return (f"layer {i}'s q/k norms span all heads ({attention.q_norm.weight.numel()} values, OLMoE's), not "
                    f"each head ({attention.head_dim}), which the attention kernel normalises")
        if param.dtype != layer.input_layernorm.weight.dtype:
            return "its weights are not all of one dtype"
    if backend_setting() == "torch" or load_extension()[0] is None:
        return "the compiled extension is not loaded (`python -m hf_moe.env` says why)"
    return None


@dataclass(frozen=True)
class DecodeChoice:
    """The engine that decodes a model's tokens (ONE_OP, ATTENTION_BLOCK, COMPILED or EAGER: module docstring; an
    `Engine`) and why."""

    engine: str
    reason: str

    def __post_init__(self):
        object.__setattr__(self, "engine", Engine(self.engine))

    def __str__(self) -> str:
        return f"{self.engine} ({self.reason})"


def _call_reason(model, batch: int | None) -> str | None:
    """Why the one-op step cannot run a call of `batch` rows on `model` as it is now (None: it can)."""
    if model.training:
        return "the model is in training mode (model.eval() first)"
    attention = getattr(model.config, "_attn_implementation", "sdpa")
    if attention != "sdpa":  # eager attention's masks are additive floats, which the step does not take
        return f"its attention implementation is {attention!r}, not 'sdpa'"
    hooked = next((name or "the model" for name, m in model.named_modules()
                   if m._forward_hooks or m._forward_pre_hooks), None)
    if hooked is not None:
        return f"{hooked} has forward hooks, which the one-op step would not run"
    recorder = getattr(moe_layers(model)[0].mlp, "router_recorder", None)
    if recorder is not None and recorder.outputs is not None:
        return "routing is being recorded"
    limit = max_batch(model)
    if batch is not None and limit is not None and batch > limit:
        return f"a batch of {batch} rows: the eager bf16 experts give more than {limit} to torch's GEMMs"
    return None


def choose_decode(model, batch: int | None = None, config=None) -> DecodeChoice:
    """The engine that decodes `model`'s tokens, and why: the one place that decides (module docstring).

    `config`: the call's compile config, None for the plain call (nothing is compiled: the one-op step or eager);
    hf_moe's `DecodeCompileConfig` says with `compile=False` that nothing is compiled either, with `hf_moe_step`
    and `one_op` which step may run; any other `CompileConfig` compiles transformers' forward. `batch`: the
    rows decoded together, where known."""
    compiling = config is not None and getattr(config, "compile", True)
    if compiling and not getattr(config, "hf_moe_step", False):
        return DecodeChoice(COMPILED, "the compile config is not hf_moe's decode_compile_config()")
    reason = _attention_block_reason(model)
    if reason is not None:
        return DecodeChoice(COMPILED if compiling else EAGER, reason)
    otherwise = ATTENTION_BLOCK if compiling else EAGER
    if config is not None and not getattr(config, "one_op", True):
        return DecodeChoice(otherwise, "decode_compile_config(one_op=False) asks for the attention-block step")
    reason = one_op_reason(model) or _call_reason(model, batch)
    if reason is not None:
        return DecodeChoice(otherwise, reason)
    return DecodeChoice(ONE_OP, "every layer is one the plan's one-op step computes; nothing is compiled")


def say(model, choice: DecodeChoice) -> None:
    """Log (INFO, logger "hf_moe") which engine decodes `model` and why, once per model and choice."""
    if model.__dict__.get("_hf_moe_decode_said") != choice:
        model.__dict__["_hf_moe_decode_said"] = choice
        hint = "" if choice.engine != EAGER or getattr(model.config, "model_type", None) != "hf_moe" else (
            "; cache_implementation=\"static\" compiles a decode step instead (a minute or more on the first call)")
        logger.info("hf_moe: generate decodes with the %s engine: %s%s", choice.engine, choice.reason, hint)


def _full_attention_mask(mask):
    """The bool [B, L] mask of a decode step (transformers passes [B, 1, 1, L], or a dict of them by layer type),
    or False when the step's mask is something else (hf_moe's step then does not run)."""
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


class DecodeStep:
    """The decode step of `model` (a callable taking `forward`'s keyword arguments) for a compile config `config`
    (hf_moe.generation.DecodeCompileConfig): each decode token (one token per row on an initialised static cache)
    runs the engine `choose_decode` picks at the first decode step of each `generate` call (the one-op plan, or this
    step's compiled program), and any other call `fallback()`'s callable (transformers' compiled forward, or the
    model's forward where `config.compile` is False). With `config.huge_pages` (the default), each call's first
    step asks for the model's weights on transparent huge pages (hf_moe.huge_pages).

    Compiled on the first call (`torch.compile(fullgraph=True, dynamic=False, options=config.options)`), once per
    batch size and cache length, as transformers' own compiled step; never where `config.compile` is False.

    With `config.skip_guards`, Dynamo's guards (a check of every module attribute and weight the step reads, a few
    thousand of them) are evaluated on the first step of each `generate` call, which may recompile; the later steps
    of the call, on the same cache and shapes, skip them (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`
    around the call alone, in the caller's stance). They cost a noticeable share of a step of the quickstart's
    model (measured in docs/serving-cpu.md). Nothing that the guards check changes between two steps of one call;
    `MoEForCausalLM.generate` calls `reset` first, so a model changed between calls (quantized, its modules
    replaced) is checked, and compiled for again."""

    def __init__(self, model, config, fallback):
        self.model, self.config, self.fallback = model, config, fallback
        self.skip_guards = getattr(config, "skip_guards", True)
        self.huge_pages = getattr(config, "huge_pages", True)
        self.compiled = (torch.compile(self.forward, fullgraph=True, dynamic=False, options=config.options or None)
                         if getattr(config, "compile", True) else None)
        self.trusted = None  # the (cache, shapes) whose step passed every guard in this generate call; None: none
        # {batch: (DecodeChoice, plan or None)} of this generate call (by batch: threads may share the step)
        self.decided: dict[int, tuple] = {}
        self.huge_page_bytes = 0  # of the model's weights the kernel put on huge pages at the last call's start

    @property
    def choice(self) -> DecodeChoice | None:
        """The engine of this generate call's decode steps (None: none decided yet)."""
        return next(iter(self.decided.values()))[0] if self.decided else None

    def reset(self) -> None:
        """A `generate` call begins or ends: the next call's first step evaluates every guard again and decides its
        engine again (`choose_decode`; the plan is rebuilt there if the model changed: `plan_for`)."""
        self.trusted = None
        self.decided = {}

    def _engine(self, batch: int) -> tuple[DecodeChoice, DecodePlan | None]:
        """The engine of a decode step of `batch` rows: decided at the first step of each generate call, where the
        weights are also asked onto huge pages (hf_moe.huge_pages: the step streams them; the first time the kernel
        copies them into huge pages, later calls find that done)."""
        decided = self.decided.get(batch)
        if decided is None:
            choice = choose_decode(self.model, batch, self.config)
            say(self.model, choice)
            if self.huge_pages and not self.decided and choice.engine in (ONE_OP, ATTENTION_BLOCK):
                self.huge_page_bytes = back_with_huge_pages([*self.model.parameters(), *self.model.buffers()])
            plan = plan_for(self.model, self.huge_pages) if choice.engine == ONE_OP else None
            decided = self.decided[batch] = (choice, plan)
        return decided

    def _decode_call(self, kwargs: dict) -> tuple | None:
        """(input_ids, position_ids, mask, cache layers) of a call that is one decode token (forward's keyword
        arguments: one token per row on an initialised static cache, nothing but logits asked for), else None."""
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        extra = {"input_ids", CACHE_NAME, "position_ids", "attention_mask", "logits_to_keep", "use_cache",
                 "return_dict"}
        flags = ("output_attentions", "output_hidden_states", "output_router_logits")
        if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 1
                and isinstance(positions, torch.Tensor) and positions.shape == ids.shape
                and kwargs.get("logits_to_keep", 0) in (0, 1)
                and all(not kwargs.get(f) for f in flags) and set(kwargs) - set(flags) <= extra
                and not torch.is_grad_enabled()):
            return None
        layers = static_cache_layers(kwargs.get(CACHE_NAME))
        mask = _full_attention_mask(kwargs.get("attention_mask"))
        if (layers is None or len(layers) != len(self.model.model.layers) or layers[0][0].shape[0] != ids.shape[0]
                or mask is False):
            return None
        return ids, positions, mask, layers

    def __call__(self, **kwargs):
        call = self._decode_call(kwargs)
        engine = None if call is None else self._engine(call[0].shape[0])
        if engine is None or engine[0].engine not in (ONE_OP, ATTENTION_BLOCK):
            self.trusted = None
            return self.fallback()(**kwargs)
        choice, plan = engine
        if choice.engine == ONE_OP:  # the whole step in one op, nothing compiled
            logits = plan(*call)
        else:
            ids, _, mask, layers = call
            key = (id(layers[0][0]), len(layers), tuple(ids.shape), None if mask is None else mask.shape)
            if self.skip_guards and key == self.trusted:  # a later step of this call, on its first step's cache
                with skipping_guards():
                    logits = self.compiled(*call)
            else:
                logits = self.compiled(*call)
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


def decode_step(model, config, fallback) -> DecodeStep | None:
    """The decode step of `model` for a compile config (`hf_moe.generation.DecodeCompileConfig`), made once per
    config and kept on the model (`_hf_moe_decode_steps`: (config, step) pairs, so one compilation per config), or
    None where the config compiles and the attention-block step does not cover the model's layers (transformers'
    compiled forward then runs). Where the config compiles nothing (`compile=False`), there is always a step, and its
    fallback is the model's own forward."""
    steps = model.__dict__.setdefault("_hf_moe_decode_steps", [])
    step = next((step for known, step in steps if known == config), False)
    if step is False:
        if not getattr(config, "compile", True):
            step = DecodeStep(model, config, lambda: model.__call__)
        else:
            step = DecodeStep(model, config, fallback) if _attention_block_reason(model) is None else None
        steps.append((config, step))
    return step


def reset_decode_steps(model) -> None:
    """`DecodeStep.reset` of every step made for `model` (a new `generate` call)."""
    for _, step in model.__dict__.get("_hf_moe_decode_steps", []):
        if step is not None:
            step.reset()
