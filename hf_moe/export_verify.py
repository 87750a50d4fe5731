"""Checking a native export against the hf_moe model it came from, in bounded memory.

Two checks, which together cover every tensor and transformers' reading of the files:

1. Every tensor written is read back and compared with its source, bit for bit (`export_files.check_written`:
   one tensor in memory at a time).
2. The hf_moe model and the export, loaded by plain transformers from the files written, are run on the same
   random probe and their logits compared. By default both are cut to their first decoder layers (through the
   first MoE layer, at least two) with the embeddings, final norm and LM head: transformers reads every layer's
   tensors by the same names, so this checks the layout, the config and the arithmetic at the memory of a few
   layers. `verify="full"` runs the whole models, one after the other.

Memory: transformers maps the files it loads while it stacks the experts into fused tensors, so loading a model
takes about twice its size; the cut models keep the export within 1.5x the model's size (docs/exporting.md).
"""

from __future__ import annotations

import gc
import math
import re

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from .checkpoint import checkpoint_state_dict
from .configuration import MoEConfig
from .modeling import MoEForCausalLM

_LAYER_INDEX_FIELDS = ("moe_layers", "mlp_only_layers")  # fields that list layer indices


def verified_layers(config, full: bool) -> int:
    """How many decoder layers the logit check runs: all, or the first ones through the first MoE layer (at least
    two, so that a dense layer is run too where the model has one)."""
    total = config.num_hidden_layers
    return total if full else min(total, max(2, min(config.moe_layers) + 1))


def first_layers(config, n: int):
    """A copy of `config` (hf_moe's or a native one) for the model made of its first `n` decoder layers: per-layer
    lists (`layer_types`) cut to n, layer-index lists (`moe_layers`, `mlp_only_layers`) kept below n."""
    values = config.to_dict()
    total = values["num_hidden_layers"]
    for name in _LAYER_INDEX_FIELDS:
        if isinstance(values.get(name), list):
            values[name] = [i for i in values[name] if i < n]
    for name, value in values.items():
        if name not in _LAYER_INDEX_FIELDS and isinstance(value, list) and len(value) == total:
            values[name] = value[:n]
    values["num_hidden_layers"] = n
    if isinstance(config, MoEConfig):
        return type(config).from_dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _in_first_layers(key: str, layers_path: str, n: int) -> bool:
    match = re.match(rf"^{re.escape(layers_path)}\.(\d+)\.", key)
    return match is None or int(match.group(1)) < n


@torch.no_grad()
def hf_moe_logits(source, config, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(probe [2, 16], logits [2, 16, V]) of the hf_moe model cut to its first `n` layers, its weights read from
    `source` one tensor at a time (an `export_files` source: the checkpoint directory or the model in memory)."""
    model = MoEForCausalLM._from_config(first_layers(config, n), dtype=dtype).eval()
    missing = set(checkpoint_state_dict(model))  # what a checkpoint of it holds: per expert, tied copies once
    for key in source.shapes:
        if _in_first_layers(key, config.decoder_layers_path, n):
            model.load_state_dict({key: source.read(key)}, strict=False)  # (an expert's slice, for expert keys)
            missing.discard(key)
    if missing:
        raise ValueError(f"The hf_moe model lacks {sorted(missing)[:8]}: it cannot be compared with its export.")
    probe = torch.randint(
        0, config.get_text_config().vocab_size, (2, 16), generator=torch.Generator().manual_seed(1234)
    )
    logits = model(input_ids=probe, use_cache=False).logits.float()
    del model
    gc.collect()
    return probe, logits


@torch.no_grad()
def native_logits(directory, native_config, n: int, dtype: torch.dtype, probe: torch.Tensor):
    """(logits, problems) of the export at `directory`, loaded by plain transformers (cut to its first `n` layers
    through its config): problems lists the tensors it lacks, or holds beyond the layers cut away."""
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # the unexpected keys of the layers cut away are expected
    try:
        extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}  # (grouped_mm has no fp64)
        model, info = AutoModelForCausalLM.from_pretrained(
            directory, config=first_layers(native_config, n), dtype=dtype, output_loading_info=True, **extra
        )
    finally:
        transformers_logging.set_verbosity(verbosity)
    found = {
        "missing": info["missing_keys"],
        "unexpected": [k for k in info["unexpected_keys"] if _in_first_layers(k, "model.layers", n)],
        "mismatched": info.get("mismatched_keys") or [],
    }
    problems = {name: sorted(map(str, keys))[:8] for name, keys in found.items() if keys}
    logits = model.eval()(input_ids=probe, use_cache=False).logits.float()
    del model
    gc.collect()
    return logits, problems


FP32_UNIT_ROUNDOFF = 2.0**-24  # fp32's relative rounding error: 6e-8
TOLERANCE_FACTOR = 8


def logit_tolerance(max_abs_logit: float, width: int) -> float:
    """The largest logit difference accepted between an hf_moe model and its native export:
    8 * 2**-24 * sqrt(width) * max(1, max |logit|), `width` the longest dot product (the larger of the hidden and
    the intermediate sizes). In fp32 and fp64 alike: both models' routers take their softmax in fp32.

    The two compute the same function in other orders (docs/exporting.md, "How close"): the experts' matrix products
    are blocked differently, a token's k expert outputs are added in another order, and the routers round their
    logits differently. A dot product of length K summed in another order differs by about 2**-24 * sqrt(K) of its
    size, and the logits inherit that relative difference: the formula without its factor 8 is about what was measured
    on the tiny test models and on SmolLM2-135M, where the dense model itself differs by as much between two
    attention implementations. The factor 8 leaves a margin over those measurements, and a wrong weight (two experts
    swapped) still lands far outside the bound (the numbers: docs/exporting.md, "How close").
    """
    return TOLERANCE_FACTOR * FP32_UNIT_ROUNDOFF * math.sqrt(width) * max(1.0, max_abs_logit)


def dot_width(config) -> int:
    """The longest dot product of the model: its hidden or (expert, dense) intermediate size."""
    sizes = (config.hidden_size, config.moe_intermediate_size, getattr(config, "intermediate_size", None))
    return max(s for s in sizes if isinstance(s, int))
