"""The fast decode path: a static KV cache, and the decode step compiled once with `torch.compile`, on CPU too.

transformers' `generate` compiles its decode step by itself when the KV cache is static
(`cache_implementation="static"`), but only on accelerators: on CPU it runs the static cache eagerly (slower than the
default dynamic cache) unless the `CompileConfig` it is given carries a flag that is not public
(`_compile_all_devices`, which transformers' own tests set to compile on CPU). This module supplies that config, and
a floor on the cache length so that one compiled graph serves every call:

    model.generate(**inputs, max_new_tokens=64, cache_implementation="static")   # an hf_moe model: the one switch

works for hf_moe models because `MoEForCausalLM.generate` passes its keyword arguments through
`prepare_generate_kwargs`. Any other model (transformers' own Mixtral, with `experts_implementation="hf_moe"` or
not) gets the same path with `model.generate(**inputs, **fast_decode_kwargs())`.

What is compiled, and when (measured in benchmarks/serve_cpu.py; the tests are tests/test_decode.py):
- only the one-token decode step (the prefill runs eagerly: its length changes with every prompt);
- `fullgraph=True, dynamic=False`: the whole forward is one graph, specialised to the batch size and the cache
  length. The first call compiles (tens of seconds for a 30-layer model on 2 cores); later calls of the same batch
  size reuse it while prompt + new tokens fit in the cache, which is at least `max_cache_len` long
  (`DEFAULT_MAX_CACHE_LEN` unless given). A longer call grows the cache and compiles once more; transformers keeps
  the longest length seen, so shorter calls never shrink it again.
- The attention of every decode step reads the whole static cache (masked), so a longer floor costs a little per
  step: the floor is a trade between recompiles and that cost.
"""

from __future__ import annotations

from transformers import CompileConfig, GenerationConfig

from .compat import compile_on_every_device

# Tokens (prompt + new) the static cache holds at least. Chat turns of a small model fit; the decode step attends
# over all of them (masked), which for SmolLM2-135M (3 KV heads of 64) is 1.5 MB per layer in fp32.
DEFAULT_MAX_CACHE_LEN = 1024
STATIC = "static"


def decode_compile_config() -> CompileConfig:
    """The `CompileConfig` of the decode step: one graph (no graph break allowed), static shapes, inductor, and
    compiled on CPU too. mode="default": "reduce-overhead" (transformers' default) means CUDA graphs, which do not
    exist on CPU."""
    config = CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode="default")
    return compile_on_every_device(config)


def fast_decode_kwargs(max_cache_len: int = DEFAULT_MAX_CACHE_LEN) -> dict:
    """`generate` keyword arguments of the fast decode path, for any transformers model with a static cache."""
    return {"cache_implementation": STATIC, "compile_config": decode_compile_config(), "max_cache_len": max_cache_len}


def _asks_for_static_cache(model, kwargs: dict) -> bool:
    if "cache_implementation" in kwargs:
        return kwargs["cache_implementation"] == STATIC
    config = kwargs.get("generation_config")
    if isinstance(config, GenerationConfig) and config.cache_implementation is not None:
        return config.cache_implementation == STATIC
    return getattr(getattr(model, "generation_config", None), "cache_implementation", None) == STATIC


def _has_setting(model, kwargs: dict, name: str) -> bool:
    """Whether the caller (keyword, their generation_config, or the model's) already chose `name`."""
    if kwargs.get(name) is not None:
        return True
    config = kwargs.get("generation_config")
    if isinstance(config, GenerationConfig) and getattr(config, name, None) is not None:
        return True
    return getattr(getattr(model, "generation_config", None), name, None) is not None


def prepare_generate_kwargs(model, kwargs: dict) -> dict:
    """`generate`'s keyword arguments, with the fast decode path filled in when a static cache is asked for
    (`cache_implementation="static"`, as a keyword, in the `generation_config` passed, or in the model's) and the
    caller chose no `compile_config` or `max_cache_len` of their own. Anything else passes through unchanged.

    Not on models placed by accelerate (`hf_device_map`: transformers does not compile those), nor on models with a
    module that says `supports_compile = False` (offloaded experts: their cache decides on the host what to read).
    """
    if not _asks_for_static_cache(model, kwargs):
        return kwargs
    if getattr(model, "hf_device_map", None) is not None or not all(
        getattr(module, "supports_compile", True) for module in model.modules()
    ):
        return kwargs
    kwargs = dict(kwargs)
    if not _has_setting(model, kwargs, "compile_config"):
        kwargs["compile_config"] = decode_compile_config()
    if not _has_setting(model, kwargs, "max_cache_len"):
        kwargs["max_cache_len"] = DEFAULT_MAX_CACHE_LEN
    return kwargs
