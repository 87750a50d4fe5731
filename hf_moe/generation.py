"""The fast decode path: a static KV cache, and a decode step that is one op call (nothing compiled) or compiled once
with `torch.compile`, on CPU too.

`generate`'s plain call (no cache or compile arguments) gets hf_moe's one-op step where it serves the model
(`prepare_generate_kwargs`, `hf_moe.decode.choose_decode`): a static cache and the step's own loop (`one_op_sample`).
Elsewhere it stays eager, and a static cache is the switch to a compiled step:

transformers' `generate` compiles its decode step by itself when the KV cache is static
(`cache_implementation="static"`), but only on accelerators: on CPU it runs the static cache eagerly (slower than the
default dynamic cache) unless the `CompileConfig` it is given carries a flag that is not public
(`_compile_all_devices`, which transformers' own tests set to compile on CPU). This module supplies that config, and
cache lengths in powers of two, so that one compiled graph serves calls of any length up to its own:

    model.generate(**inputs, max_new_tokens=64, cache_implementation="static")   # an hf_moe model: the one switch

works for hf_moe models because `MoEForCausalLM.generate` passes its keyword arguments through
`prepare_generate_kwargs`. Any other model (transformers' own Mixtral, with `experts_implementation="hf_moe"` or
not) gets the same path with `model.generate(**inputs, **fast_decode_kwargs())`.

What is compiled, and when (measured in benchmarks/serve_cpu.py and benchmarks/decode_profile.py; the tests are
tests/test_decode.py):
- only the one-token decode step (the prefill runs eagerly: its length changes with every prompt);
- for an hf_moe model whose decoder layers are Llama's (Llama, Mistral, Qwen2, Qwen3 layers), hf_moe's attention-block
  step (hf_moe.decode: each layer's attention sub-block as one op); for any other model, transformers' forward;
- `fullgraph=True, dynamic=False`: the whole step is one graph, specialised to the batch size and the length of
  the static cache, compiled with inductor's C++ wrapper (`DECODE_OPTIONS`: its kernels called from one C++
  function, no Python between them). The first call compiles (long on CPU: docs/serving-cpu.md says how long);
  later calls of the same batch size reuse it while prompt + new tokens fit in the cache.
- The cache length is the call's need rounded up to a power of two, at least `MIN_CACHE_LEN`, and transformers keeps
  the longest length seen: a longer call compiles once more, for the next power of two, and shorter calls then
  reuse that graph. Over a process's life that is at most a handful of compilations (256, 512, 1024, ...).
- Each decode step attends over the whole static cache (masked), so the cache is kept no longer than needed: every
  unused position costs time in every layer and step (docs/serving-cpu.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers import CompileConfig, GenerationConfig

from .compat import CACHE_NAME, compile_on_every_device, pad_token_tensor, static_cache_layers
from .decode import ONE_OP, choose_decode, say
from .decode_one_op import plan_for
from .huge_pages import back_with_huge_pages
from .memory import SKIP_VARIABLE, format_bytes, free_memory, size_check_skipped
from .ops.prefill_linears import linears_on_linear_infer

MIN_CACHE_LEN = 256  # tokens (prompt + new) the static cache holds at least
STATIC = "static"
# Inductor's options for the decode step (measured in benchmarks/serve_cpu.py, docs/serving-cpu.md): the C++
# wrapper runs the step's kernels from one C++ function, without Python between them.
DECODE_OPTIONS = {"cpp_wrapper": True}


@dataclass
class DecodeCompileConfig(CompileConfig):
    """transformers' `CompileConfig`, plus `hf_moe_step`: an hf_moe model runs hf_moe's decode step (hf_moe.decode)
    where its architecture allows, compiled with the same settings (`fused`: its former name, deprecated), and
    `skip_guards`: the attention-block step checks Dynamo's guards on the first step of each `generate` call only.
    Dynamo's stance is process-wide, so a server that runs compiled code from several threads at once sets
    `skip_guards=False`; and `one_op`: where the model allows it, hf_moe's step is one call of the model's plan and
    nothing is compiled (hf_moe.decode_one_op; `one_op=False` runs the compiled attention-block step); and
    `huge_pages`: hf_moe's step asks for the weights it streams on transparent huge pages (hf_moe.huge_pages); and
    `compile`: False compiles nothing (the one-op step where it serves the model, its forward elsewhere: what
    `generate`'s plain call gets). transformers' own models ignore all five."""

    hf_moe_step: bool = True
    skip_guards: bool = True
    one_op: bool = True
    huge_pages: bool = True
    compile: bool = True

    @property
    def fused(self) -> bool:
        """Deprecated: `hf_moe_step` ("fused" names stacked expert weights only)."""
        warnings.warn("DecodeCompileConfig.fused is deprecated: use hf_moe_step", DeprecationWarning, stacklevel=2)
        return self.hf_moe_step

    @fused.setter
    def fused(self, value: bool) -> None:
        warnings.warn("DecodeCompileConfig.fused is deprecated: use hf_moe_step", DeprecationWarning, stacklevel=2)
        self.hf_moe_step = value

    def to_dict(self) -> dict:
        """`torch.compile`'s keyword arguments (transformers passes them on as they are)."""
        config = super().to_dict()
        config.pop("hf_moe_step", None)
        config.pop("skip_guards", None)
        config.pop("one_op", None)
        config.pop("huge_pages", None)
        config.pop("compile", None)
        if config.get("options"):  # torch.compile takes a mode or options; mode "default" is the options' base
            config.pop("mode", None)
        else:
            config["options"] = None
        return config


def decode_compile_config(hf_moe_step: bool = True, options: dict | None = None, skip_guards: bool = True,
                          one_op: bool = True, huge_pages: bool = True, compile: bool = True,
                          native: bool | None = None, fused: bool | None = None) -> DecodeCompileConfig:
    """The `CompileConfig` of the decode step: one graph (no graph break allowed), static shapes, inductor with
    `options` (default `DECODE_OPTIONS`), compiled on CPU too, and (hf_moe models) hf_moe's decode step unless
    `hf_moe_step=False` (`fused`: its former name, deprecated), with Dynamo's guards checked on each call's first step
    only unless `skip_guards=False`, and as one op call where the model allows it unless `one_op=False` (`native`: its
    former name, deprecated), its weights on huge pages unless `huge_pages=False` (`DecodeCompileConfig`), and nothing
    compiled at all with `compile=False`. mode="default": "reduce-overhead" (transformers' default) means CUDA graphs,
    which do not exist on CPU."""
    if native is not None:
        warnings.warn("decode_compile_config(native=...) is deprecated: pass one_op=...", DeprecationWarning,
                      stacklevel=2)
        one_op = native
    if fused is not None:
        warnings.warn("decode_compile_config(fused=...) is deprecated: pass hf_moe_step=... (\"fused\" names stacked "
                      "expert weights only)", DeprecationWarning, stacklevel=2)
        hf_moe_step = fused
    config = DecodeCompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode="default",
                                 options=dict(DECODE_OPTIONS if options is None else options), hf_moe_step=hf_moe_step,
                                 skip_guards=skip_guards, one_op=one_op, huge_pages=huge_pages, compile=compile)
    return compile_on_every_device(config)


def cache_length(needed: int) -> int:
    """The static cache length for a call that needs `needed` positions: a power of two, at least MIN_CACHE_LEN."""
    return max(MIN_CACHE_LEN, 1 << max(needed - 1, 0).bit_length())


def fast_decode_kwargs(max_cache_len: int = MIN_CACHE_LEN, **config) -> dict:
    """`generate` keyword arguments of the fast decode path, for any transformers model with a static cache
    (transformers' own Mixtral included). Calls that need more than `max_cache_len` positions grow the cache, and
    compile again, as `prepare_generate_kwargs` explains. `config`: `decode_compile_config`'s arguments."""
    return {"cache_implementation": STATIC, "compile_config": decode_compile_config(**config),
            "max_cache_len": max_cache_len}


def _asks_for_static_cache(model, kwargs: dict) -> bool:
    if "cache_implementation" in kwargs:
        return kwargs["cache_implementation"] == STATIC
    config = kwargs.get("generation_config")
    if isinstance(config, GenerationConfig) and config.cache_implementation is not None:
        return config.cache_implementation == STATIC
    return getattr(getattr(model, "generation_config", None), "cache_implementation", None) == STATIC


def _setting(model, kwargs: dict, name: str):
    """What the caller chose for `name`: as a keyword, in the generation_config they pass, or in the model's."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    config = kwargs.get("generation_config")
    if isinstance(config, GenerationConfig) and getattr(config, name, None) is not None:
        return getattr(config, name)
    return getattr(getattr(model, "generation_config", None), name, None)


def _prompt(args: tuple, kwargs: dict):
    """The prompt of a `generate` call ([B, T] ids or [B, T, H] embeddings), None when its arguments do not say."""
    prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if prompt is None:
        prompt = kwargs.get("inputs_embeds")
    return prompt if hasattr(prompt, "shape") and len(prompt.shape) >= 2 else None


def _needed_length(model, args: tuple, kwargs: dict) -> int | None:
    """Prompt + new tokens of a `generate` call, when its arguments say (None when they do not)."""
    prompt = _prompt(args, kwargs)
    if prompt is None:
        return None
    new = _setting(model, kwargs, "max_new_tokens")
    if new is not None:
        return prompt.shape[1] + new
    total = _setting(model, kwargs, "max_length")
    return total if total is not None else None


# generate's arguments by which a caller chooses how to decode; any of them set, the plain call's engine is not picked
CHOSEN = ("cache_implementation", "compile_config", "disable_compile", "assistant_model", "prompt_lookup_num_tokens",
          "assistant_early_exit", "custom_generate", "output_attentions", "output_hidden_states",
          "output_router_logits")


def _plain_batch(model, args: tuple, kwargs: dict) -> int | None:
    """The rows a `generate` call decodes together when the caller chose nothing about how to decode (no cache, cache
    implementation, compile config, beams, assistant or extra outputs: `CHOSEN`), else None."""
    if any(_setting(model, kwargs, name) for name in CHOSEN) or _setting(model, kwargs, "use_cache") is False:
        return None
    if any(kwargs.get(name) is not None for name in ("past_key_values", "cache")) or (
            _setting(model, kwargs, "num_beams") or 1) > 1:
        return None
    prompt = _prompt(args, kwargs)
    if prompt is None:
        return None
    return prompt.shape[0] * (_setting(model, kwargs, "num_return_sequences") or 1)


def _compiles(model) -> bool:
    """Whether transformers may compile the model's decode step: not placed by accelerate (`hf_device_map`), and no
    module that says `supports_compile = False` (offloaded experts: their cache decides on the host what to read)."""
    return getattr(model, "hf_device_map", None) is None and all(
        getattr(module, "supports_compile", True) for module in model.modules())


def _with_cache_length(model, args: tuple, kwargs: dict) -> dict:
    if _setting(model, kwargs, "max_cache_len") is None:
        needed = _needed_length(model, args, kwargs)
        length = cache_length(needed) if needed is not None else MIN_CACHE_LEN
        if needed is not None and length > needed and not _fits(model, args, kwargs, length):
            length = max(needed, MIN_CACHE_LEN)  # (the power of two is for reusing a compiled step, not worth an OOM)
        kwargs["max_cache_len"] = length
    return kwargs


def static_cache_bytes(config, batch: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of transformers' static KV cache of `length` positions for `batch` sequences of a model of `config`:
    keys and values [batch, KV heads, length, head_dim] in `dtype` for each layer (a sliding-window layer keeps at
    most its window)."""
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    window = getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None)
    types = getattr(text, "layer_types", None) or [None] * text.num_hidden_layers
    positions = sum(min(length, window) if window and kind in (None, "sliding_attention", "chunked_attention")
                    else length for kind in types)
    return 2 * batch * heads * head_dim * positions * torch.empty((), dtype=dtype).element_size()


def _batch(model, args: tuple, kwargs: dict) -> int | None:
    prompt = _prompt(args, kwargs)
    if prompt is None:
        return None
    return prompt.shape[0] * (_setting(model, kwargs, "num_return_sequences") or 1) * (
        _setting(model, kwargs, "num_beams") or 1)


def _cache_and_room(model, args: tuple, kwargs: dict, length: int | None) -> tuple[int, int] | None:
    """(bytes of a static cache of `length` positions for this call, bytes free where it would go); None where the
    call or the device does not say."""
    batch, parameter = _batch(model, args, kwargs), next(model.parameters(), None)
    room = None if parameter is None else free_memory(parameter.device)
    if length is None or batch is None or room is None:
        return None
    return static_cache_bytes(model.config, batch, length, parameter.dtype), room


def _fits(model, args: tuple, kwargs: dict, length: int) -> bool:
    sizes = _cache_and_room(model, args, kwargs, length)
    return sizes is None or sizes[0] <= sizes[1]


def check_static_cache(model, args: tuple, kwargs: dict) -> None:
    """Refuse, before anything is allocated, a static KV cache larger than the memory free where it would go: the
    cache is allocated (and zeroed) whole at the first forward, so a huge `max_new_tokens` would end in an allocator
    traceback, or take the memory before the first token. `HF_MOE_SKIP_SIZE_CHECK=1` goes ahead."""
    length = _setting(model, kwargs, "max_cache_len") or _needed_length(model, args, kwargs)
    sizes = None if size_check_skipped() else _cache_and_room(model, args, kwargs, length)
    if sizes is None or sizes[0] <= sizes[1]:
        return
    parameter, new = next(model.parameters()), _setting(model, kwargs, "max_new_tokens")
    raise ValueError(
        f"A static KV cache of {length:,} positions for {_batch(model, args, kwargs)} sequence(s) would take "
        f"{format_bytes(sizes[0])} ({str(parameter.dtype).removeprefix('torch.')}), but {format_bytes(sizes[1])} of "
        f"memory is free on {parameter.device}. Ask for fewer tokens"
        + (f" (max_new_tokens={new:,})" if isinstance(new, int) else "")
        + " or a smaller batch, or drop cache_implementation='static': the default dynamic cache grows only as "
        f"tokens are generated. If you know it fits, set {SKIP_VARIABLE}=1."
    )


def prepare_generate_kwargs(model, args: tuple, kwargs: dict) -> dict:
    """`generate`'s keyword arguments, with the fast decode path filled in. `args` are generate's positional
    arguments (the prompt may be one), read only.

    - The plain call (the caller chose nothing about how to decode: `_plain_batch`), where hf_moe's one-op step serves
      the model (`hf_moe.decode.choose_decode`): a static cache and the one-op step's own loop
      (`custom_generate=one_op_sample`), so each decode token is one call of the model's plan, nothing is compiled,
      and nothing of transformers' loop runs between two steps (its mask and input preparation, the forward's
      dispatch: their share of a step is measured in docs/serving-cpu.md). Where that loop does not serve
      the call (`_one_op_loop_serves`), the same plan runs inside transformers' loop
      (`decode_compile_config(compile=False)`). Elsewhere the plain call passes through unchanged (eager, nothing
      compiled either); the engine and the reason are logged once per model (INFO, logger "hf_moe").
    - A static cache asked for (`cache_implementation="static"`, as a keyword, in the `generation_config` passed, or
      in the model's): a `compile_config` that compiles on CPU too, unless the caller gave one.
    - Either way, a `max_cache_len` of the call's need rounded up to a power of two (`cache_length`; the need itself
      where the power of two would not fit in the memory free), unless the caller gave one.
    - A static cache the caller asked for that would not fit in the memory free where it goes is refused before
      anything is allocated (`check_static_cache`); the plain call then keeps transformers' dynamic cache.
    Anything the caller chose is kept as they chose it. Neither on models placed by accelerate nor on models with
    offloaded experts (`_compiles`)."""
    if not _compiles(model):
        if _asks_for_static_cache(model, kwargs):
            check_static_cache(model, args, kwargs)
        return kwargs
    if not _asks_for_static_cache(model, kwargs):
        batch = _plain_batch(model, args, kwargs)
        if batch is None:
            return kwargs
        planned = _one_op_planned(model, args, kwargs, batch)
        if planned is None:
            return kwargs
        if _one_op_loop_serves(model, planned):
            return _with_one_op_loop(planned)
        kwargs = dict(planned, cache_implementation=STATIC, compile_config=decode_compile_config(compile=False))
    else:
        kwargs = dict(kwargs)
        if _setting(model, kwargs, "compile_config") is None:
            kwargs["compile_config"] = decode_compile_config()
    kwargs = _with_cache_length(model, args, kwargs)
    check_static_cache(model, args, kwargs)
    return kwargs


def _one_op_planned(model, args: tuple, kwargs: dict, batch) -> dict | None:
    """A copy of `kwargs` with the cache length of the one-op step's static cache, where `choose_decode` picks the
    one-op step for `batch` and that cache fits; else None. The choice is logged once per model either way."""
    choice = choose_decode(model, batch)
    say(model, choice)
    if choice.engine != ONE_OP:
        return None
    planned = _with_cache_length(model, args, dict(kwargs))
    if not _fits(model, args, planned, _setting(model, planned, "max_cache_len")):
        return None  # the static cache would not fit, where transformers' dynamic one grows as it goes
    return planned


# ---------------------------------------------------------------------------------------------------------------
# The one-op step's loop, through transformers' public hook for a decoding loop (`custom_generate`), after
# transformers' own input preparation: an hf_moe model's plain call gets it from `prepare_generate_kwargs`;
# transformers' own models (Mixtral, Qwen2-MoE, Qwen3-MoE on experts_implementation="hf_moe"), whose `generate`
# hf_moe does not replace, from `hf_moe.generate`.
# ---------------------------------------------------------------------------------------------------------------

def generate(model, *args, **kwargs):
    """`model.generate(*args, **kwargs)` on the fast decode path, for any causal LM. An hf_moe model's own `generate`
    already is (`MoEForCausalLM.generate`). For transformers' own MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE loaded
    with `experts_implementation="hf_moe"`; int8 experts by `hf_moe.quantize_experts`): where the caller chose nothing
    about how to decode (`_plain_batch`) and the one-op step serves the model (`choose_decode`), transformers'
    `generate` runs as ever (inputs, logits processors, stopping criteria, a static cache of `cache_length`) with
    `custom_generate=one_op_sample`, so each decode token is one call of the model's plan and nothing is compiled.
    Elsewhere it is `model.generate(*args, **kwargs)` unchanged; the engine and the reason are logged once per model
    (INFO, logger "hf_moe")."""
    if getattr(getattr(model, "config", None), "model_type", None) == "hf_moe":
        return model.generate(*args, **kwargs)
    return model.generate(*args, **one_op_kwargs(model, args, kwargs))


def one_op_kwargs(model, args: tuple, kwargs: dict) -> dict:
    """`generate`'s keyword arguments for transformers' own model `model` with the one-op step's loop
    (`one_op_sample`) and its static cache, where the plain call may have them (`generate`); else `kwargs`."""
    batch = _plain_batch(model, args, kwargs)
    if batch is None or not _compiles(model) or not _one_op_loop_serves(model, kwargs):
        return kwargs
    planned = _one_op_planned(model, args, kwargs, batch)
    return kwargs if planned is None else _with_one_op_loop(planned)


def _one_op_loop_serves(model, kwargs: dict) -> bool:
    """Whether `one_op_sample` can run a call the one-op step serves: it prefills in one forward (no
    `prefill_chunk_size`), and ranks that keep stepping together (`synced_gpus`, expert parallelism) need
    transformers' loop."""
    return (_setting(model, kwargs, "prefill_chunk_size") is None and not kwargs.get("synced_gpus")
            and getattr(model, "expert_parallel_plan", None) is None)


def _with_one_op_loop(planned: dict) -> dict:
    """`planned` (a copy of generate's keyword arguments) with the one-op step's loop and its static cache."""
    planned.update(cache_implementation=STATIC, custom_generate=one_op_sample)
    if planned.get("streamer") is not None:  # transformers keeps `streamer` from a custom loop: it goes by this name
        planned["one_op_streamer"] = planned["streamer"]
    return planned


@torch.no_grad()
def one_op_sample(model, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
                  one_op_streamer=None, **model_kwargs):
    """transformers' sampling loop (greedy search, or multinomial sampling: `GenerationMixin._sample`), as
    `model.generate(..., custom_generate=one_op_sample)` calls it, with each decode token one call of the model's plan
    (hf_moe.decode_one_op): the prompt runs through the model's forward, filling the static cache, then every new
    token through the plan over that cache. Needs `cache_implementation="static"` and a model the one-op step serves
    (`hf_moe.generate` and an hf_moe model's plain call pass both where they apply; here, anything else is refused
    with the reason).

    input_ids [B, T] -> the sequences [B, T + new], or a `GenerateDecoderOnlyOutput` with `scores` and `logits`
    where the generation config asks for them (`return_dict_in_generate`), as `_sample` returns them."""
    from transformers.generation import GenerateDecoderOnlyOutput

    cache = model_kwargs.get(CACHE_NAME)
    choice = choose_decode(model, input_ids.shape[0])
    if choice.engine != ONE_OP:
        raise ValueError(f"The one-op decode step cannot decode this call: {choice.reason}. Call model.generate "
                         "without custom_generate (hf_moe.generate(model, ...) chooses by itself).")
    if generation_config.prefill_chunk_size is not None or generation_config.output_attentions or (
            generation_config.output_hidden_states):
        raise ValueError("The one-op decode step gives logits only: drop prefill_chunk_size, output_attentions and "
                         "output_hidden_states, or call model.generate without custom_generate.")
    # The prompt: the model's own forward (transformers' prefill of a fresh cache), its bf16 linear layers on
    # hf_moe's linear op where ATen's bf16 GEMM is slow (hf_moe.ops.prefill_linears)
    inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs)
    with linears_on_linear_infer():
        logits = model(**inputs, return_dict=True).logits[:, -1].to(copy=True, dtype=torch.float32)
    layers = static_cache_layers(cache)
    if layers is None or layers[0][0].shape[0] != input_ids.shape[0]:
        raise ValueError("The one-op decode step needs transformers' static cache: pass cache_implementation="
                         "\"static\" (hf_moe.generate(model, ...) does).")
    plan = plan_for(model)
    # The step streams every weight once per token: asked onto huge pages (hf_moe.huge_pages; the first call on
    # these weights has the kernel copy them there, later calls find that done)
    back_with_huge_pages([*model.parameters(), *model.buffers()])
    batch, length = input_ids.shape[0], layers[0][0].shape[2]
    attention, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
    mask = None  # [B, L] bool: the cache positions each row attends to (None: every one written, no padding)
    if attention is not None:
        mask = torch.zeros(batch, length, dtype=torch.bool, device=input_ids.device)
        mask[:, :attention.shape[1]] = attention.bool()
    if positions is None:
        positions = (attention.long().cumsum(-1) - 1 if attention is not None
                     else torch.arange(input_ids.shape[1], device=input_ids.device).expand(batch, -1))
    positions = positions[:, -1:].clone()  # [B, 1]

    pad = pad_token_tensor(generation_config)
    stops_at_eos = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    unfinished = torch.ones(batch, dtype=torch.long, device=input_ids.device)
    as_dict = generation_config.return_dict_in_generate
    scores = () if as_dict and generation_config.output_scores else None
    raw_logits = () if as_dict and generation_config.output_logits else None
    while True:
        next_scores = logits_processor(input_ids, logits)
        if scores is not None:
            scores += (next_scores,)
        if raw_logits is not None:
            raw_logits += (logits,)
        if generation_config.do_sample:
            tokens = torch.multinomial(torch.softmax(next_scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = torch.argmax(next_scores, dim=-1)
        if stops_at_eos:  # finished rows get padding
            tokens = tokens * unfinished + pad * (1 - unfinished)
        input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
        if one_op_streamer is not None:
            one_op_streamer.put(tokens.cpu())
        unfinished = unfinished & ~stopping_criteria(input_ids, scores)
        if unfinished.max() == 0:
            break
        at = input_ids.shape[1] - 1  # the cache position the new token is written at
        if at >= length:
            raise ValueError(f"The static cache holds {length} positions; this call needs more (max_cache_len).")
        positions += 1
        if mask is not None:
            mask[:, at] = True
        logits = plan(tokens[:, None], positions, mask, layers)[:, -1].to(dtype=torch.float32)
    if one_op_streamer is not None:
        one_op_streamer.end()
    if as_dict:
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits, attentions=None,
                                         hidden_states=None, **{CACHE_NAME: cache})
    return input_ids
