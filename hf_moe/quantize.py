"""Weight-only int8 experts for inference: `quantize_experts(model, "int8")`, saved and loaded per expert.

    model = AutoModelForCausalLM.from_pretrained(moe_dir)          # any hf_moe model (fp32 or bf16)
    hf_moe.quantize_experts(model, "int8")                         # experts: int8 weights + fp32 scales, in place
    model.generate(...)                                            # CPU: the int8 kernel (csrc/cpu/infer_cpu.cpp)
    save_quantized(model, out_dir)                                 # per expert, atomic, with checksums
    model = load_quantized(out_dir)

Only the experts are quantized (they are most of an MoE model's weights: 89% of the matrix weights of the
quickstart's SmolLM2 8x top-2); embeddings, attention, norms and routers keep their dtype, so LoRA (PEFT) and
training of any of them work unchanged, gradients flowing through the frozen int8 experts.

On disk (same files as any hf_moe checkpoint; see hf_moe.checkpoint):
    model-expert-{e}.safetensors    ...experts.{e}.gate_up_proj        I8  [2I, H]   (up_proj [I, H] without a gate)
                                    ...experts.{e}.gate_up_proj_scale  F32 [2I]      ([2I, H / g] with groups of g)
                                    ...experts.{e}.down_proj           I8  [H, I]
                                    ...experts.{e}.down_proj_scale     F32 [H]       ([H, I / g])
                                    (biases as usual, not quantized)
    config.json                     "expert_quantization": {"quant_method": "int8", "bits": 8, "group_size": null,
                                                            "symmetric": true, "scale_dtype": "float32"}
and the index records a checksum of every file, as for every hf_moe checkpoint.
`expert_quantization` is named after transformers' `quantization_config` (and keeps its `quant_method` key) but is
a field of its own: transformers acts on `quantization_config` with its own quantizers, which quantize only
nn.Linear layers, never 3-D experts.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .checkpoint import (
    HUB_KWARGS, INDEX_NAME, CheckpointError, checkpoint_config, local_expert_view, read_index, reading,
    resolve_checkpoint, save_checkpoint, validate_files,
)
from .checkpoint.guard import safe_open_file
from .checkpoint.headers import read_header
from .decode_one_op import drop_plan
from .layers import Experts
from .layers.adapter_experts import AdapterExperts
from .layers.quantized import CONFIG_FIELD, QuantizedExperts, check_group_size
from .layers.quantized_linear import QuantizedLinear
from .modeling import MoEForCausalLM, moe_model_class_for_config
from .ops.int8 import bad_scales, scale_limit
from .routing import moe_blocks

METHODS = ("int8",)


def quantization_config(method: str, group_size: int | None, linears: bool = False) -> dict:
    """The `expert_quantization` entry of config.json (`linears`: the other linear layers are int8 too)."""
    config = {"quant_method": method, "bits": 8, "group_size": group_size, "symmetric": True, "scale_dtype": "float32"}
    if linears:
        config["linears"] = True
    return config


def linear_targets(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the linear layers `quantize_experts(..., linears=True)` quantizes: every `nn.Linear` but
    the routers (and Qwen2-MoE's shared-expert gate), which decide which experts run and stay in full precision:
    the attention projections, dense MLPs, shared experts and the LM head."""
    keep = {id(m) for block in moe_blocks(model) for part in (block.gate, block.shared_expert_gate)
            if part is not None for m in part.modules()}
    return [(name, module) for name, module in model.named_modules()
            if type(module) is nn.Linear and id(module) not in keep]


def _untie_output_embeddings(model: nn.Module) -> None:
    """The LM head becomes an int8 copy of the embedding it was tied to: say so in the config (and its text config,
    for models that have one), so that transformers never ties them again (on load, or `tie_weights`)."""
    config = model.config
    for c in (config, config.get_text_config()):
        c.tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):  # what save_pretrained leaves out as tied duplicates
        model.all_tied_weights_keys = {}


def _fused_experts(module: nn.Module) -> bool:
    """hf_moe's `Experts`, or a transformers experts module with the same fused layout (Mixtral, Qwen3-MoE, ...)."""
    if isinstance(module, Experts):
        return True
    if isinstance(module, QuantizedExperts):
        return False
    up = getattr(module, "gate_up_proj" if getattr(module, "has_gate", False) else "up_proj", None)
    down = getattr(module, "down_proj", None)
    return (isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor) and up.dim() == 3 and down.dim() == 3
            and up.is_floating_point()
            and not getattr(module, "is_transposed", False) and getattr(module, "is_concatenated", True))


@torch.no_grad()
def quantize_experts(model: nn.Module, method: str = "int8", *, group_size: int | None = None,
                     linears: bool = False) -> nn.Module:
    """Replace every MoE layer's experts of `model` by int8 ones (`QuantizedExperts`), in place; returns `model`.

    Args:
        method: "int8": weight-only, symmetric, one fp32 scale per output channel of each expert (or per group).
        group_size: None (per output channel, the default: measured to keep the quality, see docs/serving.md), or
            a multiple of 32 dividing the hidden and intermediate sizes, for one scale per group of that many inputs.
        linears: also the other linear layers (`linear_targets`: attention projections, dense MLPs, shared experts,
            the LM head; not the routers) become int8 (`QuantizedLinear`, the same format). A tied LM head becomes
            an int8 copy of the embedding, which stays in full precision for the lookup.
    Records the choice in `model.config.expert_quantization`, which `save_quantized` writes to config.json.
    """
    if method not in METHODS:
        raise ValueError(f"Unknown expert quantization {method!r}; supported: {', '.join(METHODS)}.")
    if linears:
        _check_linears(model, group_size)
    targets = [(name, module) for name, module in model.named_modules() if _fused_experts(module)]
    if not targets and any(isinstance(m, AdapterExperts) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__} has adapter experts (one frozen MLP shared by all, plus per-expert adapters), "
            "which hold no per-expert weights to quantize. Materialize them into plain experts first, then quantize: "
            "hf_moe.quantize_experts(hf_moe.materialize(model)) (or `hf-moe materialize IN OUT`). PESC experts (an "
            "adapter on the MLP's output) cannot be materialized, so they cannot be int8 experts."
        )
    if not targets:
        done = any(isinstance(m, QuantizedExperts) for m in model.modules())
        raise ValueError(
            f"{type(model).__name__} has no experts to quantize"
            + (": they are quantized already." if done else
               " (no hf_moe Experts module, nor a transformers experts module with fused 3-D weights). "
               "Convert a dense model first with hf_moe.convert_to_moe.")
        )
    drop_plan(model)  # the one-op decode step's plan holds the weights replaced here: they go now, not at next use
    for name, module in targets:
        if getattr(module, "ep_plan", None) is not None or isinstance(module.down_proj, DTensor):
            raise NotImplementedError(
                "quantize_experts does not take expert-parallel (sharded) experts: quantize the model on one "
                "process, save it with save_quantized, and serve it from there."
            )
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, QuantizedExperts.from_experts(module, group_size))
        del module
    if linears:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for name, module in linear_targets(model):
            model.set_submodule(name, QuantizedLinear.from_linear(module, group_size))
            if module is head:
                _untie_output_embeddings(model)
    if getattr(model, "config", None) is not None:
        setattr(model.config, CONFIG_FIELD, quantization_config(method, group_size, linears))
    return model


def _check_linears(model: nn.Module, group_size: int | None) -> None:
    """Before anything changes: every target can take `group_size`, and no PEFT adapter wraps one."""
    targets = linear_targets(model)
    for name, module in targets:
        if group_size is not None and module.in_features % group_size:
            raise ValueError(f"group_size={group_size} does not divide {name}'s {module.in_features} inputs: pick a "
                             "group size that divides every linear layer's input size, or None (per channel).")
    if any(hasattr(m, "base_layer") for m in model.modules()):
        raise ValueError("The model has PEFT adapters on its linear layers: merge them first "
                         "(model.merge_and_unload()), then quantize the linear layers.")


# --------------------------------------------------------------------------------------------------------------
# Saving and loading
# --------------------------------------------------------------------------------------------------------------
def quantized_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with the tensors of every `QuantizedExperts` split per expert (views):
    `...experts.gate_up_proj` [E, 2I, H] -> `...experts.{e}.gate_up_proj` [2I, H], and so for scales and biases."""
    names = {
        f"{module_name}.{name}"
        for module_name, module in model.named_modules()
        if isinstance(module, QuantizedExperts)
        for name, buffer in module.named_buffers(recurse=False)
        if buffer is not None
    }
    out = {}
    for key, tensor in model.state_dict().items():
        if key in names:
            head, _, name = key.rpartition(".")
            out.update({f"{head}.{e}.{name}": tensor[e] for e in range(tensor.shape[0])})
        else:
            out[key] = tensor
    return out


def save_quantized(model: nn.Module, save_directory: str | os.PathLike, **kwargs) -> None:
    """Save a model with int8 experts in the per-expert layout (module docstring), atomically and with the checksum
    of every file in the index, through `hf_moe.checkpoint.save_checkpoint` (kwargs: `max_shard_size`, ...)."""
    if getattr(model.config, CONFIG_FIELD, None) is None:
        raise ValueError("This model has no int8 experts (config.expert_quantization is unset): save it with "
                         "save_pretrained, or call hf_moe.quantize_experts(model, 'int8') first.")
    save_checkpoint(model, save_directory, state_dict=quantized_state_dict(model), **kwargs)


def load_quantized(directory: str | os.PathLike, *, verify_checksums: bool = True, **kwargs) -> MoEForCausalLM:
    """Load a model saved by `save_quantized`, from a directory or a Hub id (`revision`, `cache_dir`, `subfolder`, ...
    as for `from_pretrained`; other kwargs go to `from_pretrained`: `dtype`, `attn_implementation`, ...).

    Checks the directory first (`hf_moe.checkpoint.validate_files`): every file's size and header against the
    checksums recorded at save time (`verify_checksums` hashes the data too), the config files against theirs, the
    config's `expert_quantization`, and the dtype and shape of every int8 weight and scale. A save into the directory
    meanwhile waits until the load is done. The non-expert weights load through transformers (from a view of the
    directory without the expert files), into a model whose experts are placeholders, so no full-precision expert
    is ever allocated; the int8 experts are then read from their files.
    """
    name = os.fspath(directory)
    hub = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}  # a Hub id: its snapshot in the cache
    directory = os.path.join(resolve_checkpoint(name, **hub), hub.get("subfolder") or "")
    with reading(directory):  # what is checked and loaded is one checkpoint: a save into it waits
        validate_files(directory, verify_checksums=verify_checksums)
        config = checkpoint_config(directory)
        settings = getattr(config, CONFIG_FIELD, None)
        if not isinstance(settings, dict) or settings.get("quant_method") not in METHODS:
            raise CheckpointError(
                f"{directory}/config.json has no valid `{CONFIG_FIELD}` (got {settings!r}): it holds no int8 "
                "experts. Load it with MoEForCausalLM.from_pretrained."
            )
        group_size = settings.get("group_size")
        try:
            check_group_size(group_size, config.hidden_size, config.moe_intermediate_size)
        except ValueError as err:
            raise CheckpointError(f"{directory}/config.json's {CONFIG_FIELD} is invalid: {err}") from None
        weight_map, _ = read_index(directory)
        expected = _expected_quantized_tensors(directory, config, weight_map, group_size)
        model_class = moe_model_class_for_config(config)
        linears = _linear_layout(model_class, config) if settings.get("linears") else {}
        linear_keys = _expected_linear_tensors(linears, group_size)
        _check_headers(directory, weight_map, linear_keys, "int8 linear")
        with local_expert_view(directory, 0, 0) as view:  # the non-expert files only
            skeleton = _with_placeholders(model_class, tuple(linears))
            model = skeleton.from_pretrained(view, config=config, _validated=True, **kwargs)
        model.__class__ = model_class
        model.config.name_or_path = name
        _read_experts(directory, model, config, weight_map, expected, group_size)
        _read_linears(directory, model, weight_map, linears, group_size)
    return model


def _expected_quantized_tensors(directory: str, config, weight_map: dict[str, str], group_size) -> dict[str, tuple]:
    """{on-disk key: (safetensors dtype, shape)} of every expert tensor the config calls for, after checking each
    against the file's header."""
    h, i = config.hidden_size, config.moe_intermediate_size
    up = "gate_up_proj" if config.expert_glu else "up_proj"
    rows = {up: 2 * i if config.expert_glu else i, "down_proj": h}
    inputs = {up: h, "down_proj": i}
    expected = {}
    for layer in config.moe_layers:
        prefix = f"{config.decoder_layers_path}.{layer}.{config.moe_block_path}.experts"
        for e in range(config.num_experts):
            for name in (up, "down_proj"):
                scale = [rows[name]] if group_size is None else [rows[name], inputs[name] // group_size]
                expected[f"{prefix}.{e}.{name}"] = ("I8", [rows[name], inputs[name]])
                expected[f"{prefix}.{e}.{name}_scale"] = ("F32", scale)
                if config.expert_bias:
                    expected[f"{prefix}.{e}.{name}_bias"] = (None, [rows[name]])
    _check_headers(directory, weight_map, expected, "int8 expert")
    return expected


def _check_headers(directory: str, weight_map: dict[str, str], expected: dict[str, tuple], what: str) -> None:
    """Every key of `expected` ({key: (safetensors dtype or None for any floating type, shape)}) is in the index,
    with that dtype and shape in its file's header."""
    missing = [key for key in expected if key not in weight_map]
    if missing:
        raise CheckpointError(f"{directory} lacks {len(missing)} {what} tensor(s), e.g. {missing[0]}: the save "
                              "was incomplete. Save the model again.")
    headers = {}
    for key, (dtype, shape) in expected.items():
        filename = weight_map[key]
        if filename not in headers:
            headers[filename] = read_header(directory, filename, INDEX_NAME)[0]
        meta = headers[filename][key]
        floating = meta["dtype"] in ("F32", "F16", "BF16", "F64")
        if (meta["dtype"] != dtype if dtype else not floating) or meta["shape"] != shape:
            raise CheckpointError(
                f"{filename} stores {key} as {meta['dtype']} {meta['shape']}, but config.json's {CONFIG_FIELD} "
                f"makes it {dtype or 'floating point'} {shape}. Restore the file, or save the model again."
            )


def _linear_layout(model_class: type, config) -> dict[str, tuple[int, int, bool]]:
    """{name: (in_features, out_features, has_bias)} of the linear layers `quantize_experts(..., linears=True)`
    made int8 in a model of this config (`linear_targets`, on a model built on the meta device)."""
    with torch.device("meta"):
        shell = model_class(config)
    return {name: (m.in_features, m.out_features, m.bias is not None) for name, m in linear_targets(shell)}


def _expected_linear_tensors(linears: dict, group_size) -> dict[str, tuple]:
    expected = {}
    for name, (inputs, outputs, bias) in linears.items():
        expected[f"{name}.weight"] = ("I8", [outputs, inputs])
        expected[f"{name}.weight_scale"] = ("F32", [outputs] if group_size is None else [outputs, inputs // group_size])
        if bias:
            expected[f"{name}.bias"] = (None, [outputs])
    return expected


class _PlaceholderExperts(nn.Module):
    """Holds a layer's place while the rest of the model loads: no tensors, so transformers expects none."""


_SKELETONS: dict[tuple, type] = {}


def _with_placeholders(model_class: type, linears: tuple[str, ...] = ()) -> type:
    """A subclass of `model_class` whose instances swap each MoE block's experts, and the linear layers named in
    `linears`, for placeholders as soon as they are built (on the meta device, inside from_pretrained): no expert
    or int8 layer weight is allocated or expected."""
    if (model_class, linears) not in _SKELETONS:

        def __init__(self, config, *args, **kwargs):
            model_class.__init__(self, config, *args, **kwargs)
            for block in moe_blocks(self):
                block.experts = _PlaceholderExperts()
            for name in linears:
                self.set_submodule(name, _PlaceholderExperts())

        # the int8 linear layers' tensors are read below, as the experts' are: transformers leaves them
        ignored = [f"^{re.escape(name)}\\.(weight|weight_scale|bias)$" for name in linears]
        _SKELETONS[model_class, linears] = type(model_class.__name__, (model_class,), {
            "__init__": __init__, "__module__": model_class.__module__, "__qualname__": model_class.__qualname__,
            "_keys_to_ignore_on_load_unexpected": [*(model_class._keys_to_ignore_on_load_unexpected or []), *ignored]})
    return _SKELETONS[model_class, linears]


@torch.no_grad()
def _read_experts(directory: str, model, config, weight_map: dict[str, str], expected: dict, group_size) -> None:
    """Build each MoE block's `QuantizedExperts` from the expert files (checked by `_expected_quantized_tensors`)."""
    blocks = moe_blocks(model)
    dtype = next(model.parameters()).dtype
    prefixes = [f"{config.decoder_layers_path}.{layer}.{config.moe_block_path}.experts" for layer in config.moe_layers]
    quantized = [QuantizedExperts.from_config(config).to(dtype) for _ in blocks]  # (scales stay fp32)
    by_file: dict[str, list[str]] = {}
    for key in expected:
        by_file.setdefault(weight_map[key], []).append(key)
    layer_of = {prefix: i for i, prefix in enumerate(prefixes)}
    for filename, keys in by_file.items():
        with safe_open_file(directory, filename, INDEX_NAME) as f:
            for key in keys:
                prefix, expert, name = key.rsplit(".", 2)
                tensor = f.get_tensor(key)
                if name.endswith("_scale"):
                    _check_scales(filename, key, tensor, expected[key.removesuffix("_scale")][1][-1])
                getattr(quantized[layer_of[prefix]], name)[int(expert)].copy_(tensor)
    device = next(model.parameters()).device
    for block, experts in zip(blocks, quantized, strict=True):
        block.experts = experts.to(device)


@torch.no_grad()
def _read_linears(directory: str, model, weight_map: dict[str, str], linears: dict, group_size) -> None:
    """Build each int8 linear layer (`QuantizedLinear`) from its tensors (checked by `_check_headers`)."""
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    for name, (inputs, outputs, bias) in linears.items():
        module = QuantizedLinear(inputs, outputs, bias, group_size, bias_dtype=dtype)
        for attr in ("weight", "weight_scale", "bias") if bias else ("weight", "weight_scale"):
            key = f"{name}.{attr}"
            with safe_open_file(directory, weight_map[key], INDEX_NAME) as f:
                tensor = f.get_tensor(key)
            if attr == "weight_scale":
                _check_scales(weight_map[key], key, tensor, inputs)
            getattr(module, attr).copy_(tensor)
        model.set_submodule(name, module.to(device))


def _check_scales(filename: str, key: str, scale: torch.Tensor, in_features: int) -> None:
    """`scale` (int8 scales of rows of `in_features` inputs, read from `filename`) is sound (`bad_scales`)."""
    bad = bad_scales(scale, in_features)
    if bad:
        raise CheckpointError(
            f"{filename} is corrupt: {key} holds {bad} NaN, infinite, negative or too large scale(s) (at most "
            f"{scale_limit(in_features):.3g} for rows of {in_features} inputs), which compute non-finite outputs. "
            "Restore the file, or quantize the model again from finite weights and save it."
        )
