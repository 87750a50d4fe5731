"""Adapter experts: conversion options, blocks built from a dense MLP, the reference to the base checkpoint,
and loading a saved adapter-expert checkpoint back onto its base.

The layer is `hf_moe.layers.adapter_experts.AdapterExperts`. A checkpoint holds only what was trained (routers,
adapters, and any parameter the user unfroze: `trained_state_dict`); everything else is the base model's. Its config
records the base (`adapter_experts["base_model"]`): where it was (a local directory, made absolute, or a Hub id) and a
fingerprint of the frozen tensors as the conversion held them (xxh3-128 over each tensor's name, dtype, shape and
bytes, in name order); the base's config is the checkpoint's own less the MoE fields. So a base that is missing, moved,
not the same weights or not the same config (`adapter_base.py`: every field that changes what it computes) is an
error that says which, never a model that silently computes something else. The fingerprint is of the weights, not of
the files: the same weights saved in another layout or shard size still match; the same model at another revision or
dtype does not.

Loading (`MoEForCausalLM.from_pretrained(dir)`, `AutoModelForCausalLM.from_pretrained(dir)`): the checkpoint is
checked (`validate_checkpoint`: index, checksums, every adapter and router tensor present with its shape), the base
is loaded (`base=` overrides the recorded one: a path, a Hub id, or the dense model itself, which is copied, not
changed), its config compared before its weights are read, its MLPs become adapter blocks (zero adapters), the
fingerprint is compared, and the saved tensors are loaded over them.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import torch
from torch import nn

from ..checkpoint import (
    CHECKSUM_ALGORITHM, CHECKSUM_ALGORITHMS, INDEX_NAME, CheckpointError, checkpoint_config, read_index, read_json,
    reading, validate_checkpoint,
)
from ..checkpoint.guard import load_safetensors
from ..compat import attn_implementation
from ..layers import SparseMoeBlock, build_router
from ..layers.adapter_experts import (
    ADAPTER_METHODS, LORA_TARGETS, AdapterExperts, adapter_blocks, adapter_shapes, always_saved, check_adapter_spec,
    current_key, fingerprint_key,
)
from .adapter_base import base_name, load_base
from .adapters import DenseMLP, extract_mlp, find_decoder_layers, find_mlp
from .estimate import ConversionSize, format_bytes

# convert_to_moe options of the adapter methods, with their defaults (PEFT's names).
ADAPTER_OPTIONS: dict[str, Any] = {
    "rank": 16,  # r: the adapters' rank (lora) or bottleneck width (pesc); `r` is accepted as its PEFT name
    "lora_alpha": None,  # scaling = lora_alpha / rank; default 2 * rank (MixLoRA's ratio)
    "target_modules": None,  # lora: which of gate_proj, up_proj, down_proj get adapters (default: all the MLP has)
    "lora_dropout": 0.0,  # dropout on the adapters' input (training only)
    "adapter_act": "gelu",  # pesc: the bottleneck's activation (Camelidae's)
}
METHOD_OPTION_NAMES = {
    "lora": ("rank", "r", "lora_alpha", "target_modules", "lora_dropout"),
    "pesc": ("rank", "r", "lora_alpha", "lora_dropout", "adapter_act"),
}
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def adapter_spec(method: str, opts: dict, glu: bool) -> dict:
    """The config's `adapter_experts` record for a conversion (without `base_model`, added once the model exists)."""
    rank = opts.get("r") if opts.get("r") is not None else opts["rank"]
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
        raise ValueError(f"rank must be a positive int, got {rank!r}.")
    alpha = opts["lora_alpha"] if opts["lora_alpha"] is not None else 2 * rank
    spec = {"method": method, "r": rank, "lora_alpha": alpha, "lora_dropout": opts["lora_dropout"]}
    if method == "lora":
        targets = opts["target_modules"]
        if targets is None:
            targets = [t for t in LORA_TARGETS if glu or t != "gate_proj"]
        elif isinstance(targets, str):
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        spec["target_modules"] = list(targets)
    else:
        spec["adapter_act"] = opts["adapter_act"]
    return spec


def adapter_size(spec: dict, mlp: DenseMLP, num_experts: int, num_layers: int) -> tuple[ConversionSize, str]:
    """(What the adapter experts of `spec` on MLPs like `mlp` add to the dense model, a hint naming the rank): for
    `estimate.check_memory`, before any adapter exists. Adapters are fp32 on a 16-bit MLP (`adapter_block`)."""
    itemsize = mlp.up.element_size()
    adapter_itemsize = 4 if mlp.up.dtype in (torch.float16, torch.bfloat16) else itemsize
    shapes = adapter_shapes(spec, mlp.hidden_size, mlp.intermediate_size)
    expert = sum(rows * cols for rows, cols in shapes.values()) * adapter_itemsize
    router = num_experts * mlp.hidden_size * itemsize
    added = num_layers * (num_experts * expert + router)
    hint = (f"The adapters of rank {spec['r']} take {format_bytes(expert)} per expert and layer: choose a smaller rank "
            "(rank=, `--rank`).")
    return ConversionSize(added, added, num_experts + 1, num_experts, num_layers, expert), hint


def check_adapter_options(method: str, options: dict, opts: dict) -> None:
    """For an adapter method: the rank is given once, its options are valid, and no option of the other methods
    conflicts with it. (Options of the adapter methods given to another method are `_check_method_options`'s.)"""
    if method in ADAPTER_METHODS:
        if "rank" in options and "r" in options:
            raise ValueError("Pass the rank once: `rank` or its PEFT name `r`, not both.")
        if opts["num_shared_experts"]:
            raise ValueError(f"method={method!r} makes every expert the whole frozen MLP plus an adapter: there is "
                             "nothing left to share (num_shared_experts must be 0).")
        check_adapter_spec(adapter_spec(method, opts, glu=True), glu=True, name="the options")


def adapter_block(mlp: DenseMLP, config, generator: torch.Generator | None = None) -> SparseMoeBlock:
    """An MoE block whose experts are `mlp` (frozen, its tensors shared, not copied) plus per-expert adapters:
    A (and D) drawn as PEFT draws LoRA's A, B (and U) zero, so the block computes `mlp` exactly. The router is drawn
    from N(0, config.moe_init_std). Adapters are fp32 when the MLP is 16-bit (as PEFT's autocast_adapter_dtype)."""
    device, dtype = mlp.up.device, mlp.up.dtype
    with torch.device("meta"):
        block = SparseMoeBlock(config)
    experts: AdapterExperts = block.experts
    base = experts.dense_mlp
    for name, tensor in (("gate_proj", mlp.gate), ("up_proj", mlp.up), ("down_proj", mlp.down)):
        if tensor is None:
            continue
        base.register_parameter(name, nn.Parameter(tensor.detach(), requires_grad=False))
        if config.expert_bias:
            bias = getattr(mlp, f"{name.removesuffix('_proj')}_bias")
            bias = bias.detach() if bias is not None else tensor.new_zeros(tensor.shape[0])
            base.register_parameter(f"{name}_bias", nn.Parameter(bias, requires_grad=False))
    adapter_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    for name, param in list(experts.named_parameters(recurse=False)):
        experts.register_parameter(name, nn.Parameter(torch.empty(param.shape, device=device, dtype=adapter_dtype)))
    router = torch.randn(config.num_experts, mlp.hidden_size, generator=generator) * config.moe_init_std
    experts.reset_parameters(generator)
    with torch.device(device):
        block.gate = build_router(config).to(dtype)
    with torch.no_grad():
        block.gate.weight.copy_(router)
    return block


def freeze_base(model: nn.Module) -> None:
    """Only the routers and adapters train: every other parameter of the model is frozen (requires_grad False)."""
    paths = list(adapter_blocks(model))
    for name, param in model.named_parameters():
        param.requires_grad_(always_saved(name, paths))


# --------------------------------------------------------------------------------------------------------------------
# The base checkpoint
# --------------------------------------------------------------------------------------------------------------------
def base_fingerprint(model: nn.Module) -> dict[str, Any]:
    """{"fingerprint", "structure", "tensors"}: hashes of the frozen tensors (every state-dict entry an adapter
    checkpoint does not save) by name, dtype, shape and bytes ("structure": without the bytes), and their count."""
    new = CHECKSUM_ALGORITHMS[CHECKSUM_ALGORITHM]
    values, structure = new(), new()
    paths = list(adapter_blocks(model))
    count = 0
    for key, tensor in sorted(model.state_dict().items()):
        if always_saved(key, paths):
            continue
        meta = f"{fingerprint_key(key)}:{str(tensor.dtype).removeprefix('torch.')}:{list(tensor.shape)};".encode()
        structure.update(meta)
        values.update(meta)
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        values.update(data.view(torch.uint8).numpy() if data.numel() else b"")
        count += 1
    return {"fingerprint": f"{CHECKSUM_ALGORITHM}:{values.hexdigest()}",
            "structure": f"{CHECKSUM_ALGORITHM}:{structure.hexdigest()}", "tensors": count}


def base_reference(model: nn.Module, source: str | None, dtype: torch.dtype) -> dict[str, Any]:
    """The config's `adapter_experts["base_model"]`: where the base is (an absolute local path, a Hub id, or None
    for a model built in memory), the dtype the dense model was converted in (`PreTrainedModel.dtype`: what its
    `from_pretrained` is given at load), and the fingerprint of the frozen tensors."""
    name = None
    if isinstance(source, str) and source:
        if os.path.isdir(source):
            name = os.path.abspath(source)
        elif _HUB_ID.fullmatch(source) and not os.path.exists(source):
            name = source
    dtype_name = str(dtype).removeprefix("torch.")
    if any(p.device.type == "meta" for p in model.parameters()):  # (hf-moe plan converts on meta: no weights)
        return {"name_or_path": name, "dtype": dtype_name, "fingerprint": None, "structure": None, "tensors": 0}
    return {"name_or_path": name, "dtype": dtype_name, **base_fingerprint(model)}


def is_adapter_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether `directory` is a local hf_moe checkpoint of adapter experts (its config.json has `adapter_experts`)."""
    directory = os.fspath(directory)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        return False
    try:
        config = read_json(directory, "config.json", "the checkpoint")
    except (CheckpointError, OSError):
        return False  # the ordinary load reports what is wrong with it
    return config.get("model_type") == "hf_moe" and config.get("adapter_experts") is not None


def load_adapter_model(cls, directory: str | os.PathLike, *model_args, base=None, verify_checksums=None, **kwargs):
    """An adapter-expert checkpoint loaded onto its base (see the module docstring); `cls` is the hf_moe head class
    `from_pretrained` was called on. Keyword arguments naming a config field set it (as `from_pretrained` does);
    `dtype` is the dtype of the model returned; the others go to the base model's `from_pretrained`
    (`device_map`, `attn_implementation`, ...)."""
    directory = os.fspath(directory)
    if model_args:
        raise TypeError("from_pretrained of an adapter-expert checkpoint takes no positional model arguments.")
    given_config = kwargs.pop("config", None)  # (AutoModelForCausalLM passes the one it read from `directory`)
    if given_config is not None and getattr(given_config, "adapter_experts", None) is None:
        raise ValueError(f"{directory} holds adapter experts; config= must be an adapter-expert config too.")
    for name in ("expert_parallel", "offload_experts", "max_expert_memory"):
        if kwargs.get(name) not in (None, False):
            raise ValueError(
                f"{directory} holds adapter experts, which load onto their base model in memory; `{name}` applies to "
                "plain experts. Materialize them first: `hf-moe materialize DIR OUT` (or hf_moe.materialize)."
            )
        kwargs.pop(name, None)
    kwargs.pop("output_loading_info", None)
    with reading(directory):  # the checks and the tensors read come from one checkpoint: a save into it waits
        validate_checkpoint(directory, verify_checksums=verify_checksums, model_class=cls)
        config = copy.deepcopy(given_config) if given_config is not None else checkpoint_config(directory)
        weight_map, _ = read_index(directory)
        tensors = {}
        for filename in sorted(set(weight_map.values())):
            tensors.update(load_safetensors(directory, filename, INDEX_NAME))
    tensors = {current_key(k): v for k, v in tensors.items()}  # (the frozen MLP's former name, if the user unfroze it)
    fields = [k for k in list(kwargs) if hasattr(config, k) and k not in ("dtype", "torch_dtype")]
    for name in fields:
        setattr(config, name, kwargs.pop(name))
    config._validate_moe()
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
    for name in [k for k in kwargs if k.startswith("_")]:  # the Auto classes' bookkeeping (`_from_auto`, ...)
        kwargs.pop(name)
    dense = load_base(cls, config, directory, base, kwargs)  # (its config checked first; a model passed is copied)
    model = build_on_dense(cls, dense, config)
    _check_fingerprint(model, config, directory, base)
    if dtype not in (None, "auto"):
        model.to(dtype)
        _adapters_in_fp32(model)
    elif config.dtype is not None and str(config.dtype) != str(next(model.parameters()).dtype).removeprefix("torch."):
        model.to(getattr(torch, str(config.dtype).removeprefix("torch.")))
        _adapters_in_fp32(model)
    result = model.load_state_dict(tensors, strict=False)
    if result.unexpected_keys:  # (validate_checkpoint has checked every key against the config: never expected)
        raise CheckpointError(f"{directory} holds tensors this model has no place for: {result.unexpected_keys[:5]}.")
    paths = list(adapter_blocks(model))
    extra = {k for k in tensors if not always_saved(k, paths)}  # parameters the user had unfrozen: they stay trainable
    for name, param in model.named_parameters():
        if name in extra:
            param.requires_grad_(True)
    model.config.name_or_path = directory
    return model.eval()


def build_on_dense(cls, dense: nn.Module, config) -> nn.Module:
    """`dense` turned in place into the model of `config` (adapter experts with zero adapters), base frozen."""
    _, layers = find_decoder_layers(dense)
    generator = torch.Generator().manual_seed(0)  # (the adapters' values are loaded over; any draw does)
    blocks = {}
    for i in config.moe_layers:
        mlp = extract_mlp(layers[i], find_mlp(layers[i]), dense.config)
        blocks[i] = adapter_block(mlp, config, generator)
    attention = attn_implementation(dense.config)  # (a config read from disk names none: the base's runs)
    model = cls.from_dense(dense, config, blocks)
    if attention is not None:
        model.set_attn_implementation(attention)
    freeze_base(model)
    return model


def _check_fingerprint(model: nn.Module, config, directory: str, base) -> None:
    ref = config.adapter_experts.get("base_model") or {}
    if not ref.get("fingerprint"):
        return  # (converted on the meta device: nothing was recorded)
    found = base_fingerprint(model)
    if found["fingerprint"] == ref["fingerprint"]:
        return
    source = base_name(config, base)
    if found["structure"] == ref["structure"]:
        why = ("its tensors have the names, dtypes and shapes recorded, but other values: another revision or "
               "fine-tune of the same model")
    else:
        why = (f"its tensors differ in names, dtypes or shapes ({found['tensors']} frozen tensors, {ref['tensors']} "
               "recorded): another model, or the same one in another dtype")
    raise CheckpointError(
        f"{directory} holds adapter experts trained on other weights than the base {source}: {why}. Loading them on "
        "it would give a model that was never trained. Pass the base they were converted from: "
        "from_pretrained(dir, base=PATH_OR_MODEL)."
    )


def _adapters_in_fp32(model: nn.Module) -> None:
    """Adapters stay fp32 in a 16-bit model (their updates are small; see `adapter_block`)."""
    for experts in adapter_blocks(model).values():
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.dtype in (torch.float16, torch.bfloat16):
                param.data = param.data.float()
