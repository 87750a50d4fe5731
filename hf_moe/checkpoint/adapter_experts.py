"""Adapter-expert checkpoints: the model built on a dense base, its base found and checked, and the checkpoint
loaded onto it.

The layer is `hf_moe.layers.adapter_experts.AdapterExperts`. A checkpoint holds only what was trained (routers,
adapters, and any parameter the user unfroze: `trained_state_dict`); everything else is the base model's. Its config
records the base (`adapter_experts["base_model"]`): where it was (a local directory, made absolute, or a Hub id) and a
fingerprint of the frozen tensors as the conversion held them (xxh3-128 over each tensor's name, dtype, shape and
bytes, in name order); the base's config is the checkpoint's own less the MoE fields. So a base that is missing, moved,
not the same weights or not the same config (`check_base_config`: every field that changes what it computes) is an
error that says which, never a model that silently computes something else. The fingerprint is of the weights, not of
the files: the same weights saved in another layout or shard size still match; the same model at another revision or
dtype does not.

Loading (`MoEForCausalLM.from_pretrained(dir)`, `AutoModelForCausalLM.from_pretrained(dir)`): the checkpoint is
checked (`validate_checkpoint`: index, checksums, every adapter and router tensor present with its shape), the base
is loaded (`base=` overrides the recorded one: a path, a Hub id, or the dense model itself, which is copied, not
changed), its config compared before its weights are read, its MLPs become adapter blocks (zero adapters), the
fingerprint is compared, and the saved tensors are loaded over them.

The base is identified by everything that changes what it computes: its weights (the fingerprint, checked in
`_check_fingerprint`) and its config, which the checkpoint's config holds whole (an hf_moe config is the base config
plus the MoE fields). Every field of the base config counts except those in `NOT_COMPUTED`, so a field added by a
later transformers (or a family's own) is part of the identity by default. The config is compared before a weight of
the base is read, so a base whose config gives other shapes (`num_key_value_heads`) is hf_moe's error, not a size
mismatch inside transformers. Where the base is: `base=` (a directory, a Hub id, or the dense model itself, which is
copied, never changed), else the recorded `name_or_path`; a relative recorded path names a directory relative to the
checkpoint.
"""

from __future__ import annotations

import copy
import errno
import os
import re
from typing import Any

import torch
from torch import nn

from ..compat import attn_implementation
from ..dense_mlp import DenseMLP, extract_mlp, find_decoder_layers, find_mlp
from ..layers import SparseMoeBlock, build_router
from ..layers.adapter_experts import AdapterExperts, adapter_blocks, always_saved, current_key
from ..memory import available_memory, format_bytes
from .checks import checkpoint_config, read_index
from .fingerprint import base_fingerprint, record_digests
from .format import INDEX_NAME, CheckpointError
from .guard import load_safetensors, read_json
from .hub import HUB_KWARGS
from .load import validate_checkpoint
from .snapshot import reading

# Base config fields that do not change what the model computes: bookkeeping, output switches, the token ids of the
# tokenizer and of generation (not read by the forward), initialisation (the weights are loaded), a choice made at
# load (attention and experts implementations) and the dtype (the fingerprint holds the weights' dtype).
NOT_COMPUTED = frozenset({
    "_name_or_path", "name_or_path", "architectures", "transformers_version", "auto_map", "hf_moe_package",
    "model_type", "dtype", "torch_dtype", "attn_implementation", "_attn_implementation", "experts_implementation",
    "_experts_implementation", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "torchscript", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "id2label", "label2id", "problem_type",
    "initializer_range", "init_std", "initializer_factor", "chunk_size_feed_forward",
})
# Fields whose difference gives the base tensors of other shapes (reported as such).
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size")
# The dtypes a base is recorded in (`PreTrainedModel.dtype` at conversion).
BASE_DTYPES = ("float32", "bfloat16", "float16", "float64")
# A Hub id as `validate_repo_id` accepts it (`org/name`): no `..`, not starting with `.` or `-` (`../dense` is a path).
_HUB_ID = re.compile(r"(?!.*\.\.)[\w][\w.-]*/[\w][\w.-]*")
_ABSENT = "(absent)"


def recorded_dtype(config, directory: str) -> torch.dtype | str:
    """The dtype the base was converted in (what its `from_pretrained` is given), or "auto" where none is recorded."""
    value = (config.adapter_experts.get("base_model") or {}).get("dtype")
    if value is None:
        return "auto"
    if not (isinstance(value, str) and value in BASE_DTYPES):
        raise CheckpointError(
            f"{directory}/config.json records adapter_experts.base_model.dtype = {_brief(value)}, which is not a dtype "
            f"a model loads in ({', '.join(BASE_DTYPES)}). Restore the value the conversion wrote (the base's dtype, "
            "e.g. 'float32'), then record the edit: `hf-moe verify --update DIR`."
        )
    return getattr(torch, value)


def base_source(config, directory: str, base) -> str:
    """The base as `from_pretrained` takes it: a local directory (absolute) or a Hub id, from `base` or the record.
    Raises CheckpointError saying what is wrong (none recorded, a file, a link loop, missing) and what to do."""
    if base is None:
        source = (config.adapter_experts.get("base_model") or {}).get("name_or_path")
        if source is None:
            raise CheckpointError(
                f"{directory} holds adapter experts on a base model that was converted from memory, so it records no "
                "path to it. Pass the base: from_pretrained(dir, base=PATH_OR_MODEL) (its weights are checked against "
                "the fingerprint recorded at conversion)."
            )
        if not isinstance(source, str) or not source:
            raise CheckpointError(
                f"{directory}/config.json records adapter_experts.base_model.name_or_path = {_brief(source)}, not a "
                "path or Hub id. Pass the base: from_pretrained(dir, base=PATH_OR_MODEL) (or `--base PATH`)."
            )
        if not os.path.isabs(source):  # a path relative to the checkpoint, unless it can only be a Hub id
            beside = os.path.normpath(os.path.join(directory, source))
            if os.path.lexists(beside) or not _HUB_ID.fullmatch(source):
                source = beside
    else:
        source = os.fspath(base)
    try:
        os.stat(source)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise CheckpointError(
                f"{directory} holds adapter experts on the base model {source}, which is a symbolic link loop (its "
                "links lead back to themselves, never to a directory). Point it at the dense model's directory, or "
                "pass that directory: from_pretrained(dir, base=PATH) (or `--base PATH`)."
            ) from None
        if _HUB_ID.fullmatch(source) and not os.path.lexists(source) and not os.path.isabs(source):
            return source  # a Hub id: resolved (and reported, if missing) by transformers
        raise CheckpointError(
            f"{directory} holds adapter experts on the base model {source}, which is not there (was it moved?). Pass "
            "its new place: from_pretrained(dir, base=PATH) (or `--base PATH`); its weights are checked against the "
            "fingerprint recorded at conversion."
        ) from None
    if not os.path.isdir(source):
        raise CheckpointError(
            f"{directory} holds adapter experts on the base model {source}, which is a file, not a directory. Pass "
            "the directory of the dense model (the one holding its config.json): from_pretrained(dir, base=PATH) (or "
            "`--base PATH`)."
        )
    return os.path.abspath(source)


def local_base(directory: str, config, base=None) -> str | None:
    """The base's local directory (absolute), or None for a Hub id, a model object or none recorded. For the commands
    that write: nothing may be written into it."""
    if isinstance(base, nn.Module):
        return None
    try:
        source = base_source(config, directory, base)
    except CheckpointError:
        return None  # (the load says what is wrong)
    return source if os.path.isdir(source) else None


def load_base(cls, config, directory: str, base, kwargs: dict) -> nn.Module:
    """The dense base model, its config checked against the record before any weight is read: a copy of `base` (a
    model), or the model at `base` (a path or Hub id) or at the recorded place. `kwargs` go to its `from_pretrained`."""
    dtype = recorded_dtype(config, directory)
    if isinstance(base, nn.Module):
        _check_model_object(base, directory)
        check_base_config(base.config, config, directory, base)
        return _copy(base, directory)
    source = base_source(config, directory, base)
    from transformers import AutoConfig

    hub = {k: kwargs[k] for k in (*HUB_KWARGS, "trust_remote_code") if k in kwargs}
    try:
        base_config = AutoConfig.from_pretrained(source, **hub)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(
            f"{directory} holds adapter experts on the base model {source}, whose config could not be read ({err}). "
            "Pass the base: from_pretrained(dir, base=PATH_OR_MODEL)."
        ) from None
    check_base_config(base_config, config, directory, base)
    head = cls.base_model_class
    if head is None:
        head = cls.head_mapping[type(config).base_config_class]
        head = head[0] if isinstance(head, (list, tuple)) else head
    try:
        dense = head.from_pretrained(source, config=base_config, dtype=dtype, **kwargs)
    except (OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(
            f"{directory} holds adapter experts on the base model {source}, which could not be loaded ({err}). Pass "
            "the base: from_pretrained(dir, base=PATH_OR_MODEL)."
        ) from None
    # A save of the model refers to the base it was loaded onto (`base=`, a relative record), by absolute path
    if isinstance(config.adapter_experts.get("base_model"), dict):
        config.adapter_experts["base_model"] = {**config.adapter_experts["base_model"], "name_or_path": source}
    return dense


def check_base_config(base_config, config, directory: str, base) -> None:
    """The base's config is the one recorded (`config` less the MoE fields), but for `NOT_COMPUTED`: else a
    CheckpointError naming the fields that differ."""
    ours = config.to_base_config()
    if type(ours) is not type(base_config):
        differences = [f"model_type {getattr(base_config, 'model_type', None)!r}, not {ours.model_type!r}"]
    else:
        differences = config_differences(ours.to_dict(), base_config.to_dict())
    if not differences:
        return
    name = base_name(config, base)
    listed = "; ".join(differences[:4]) + (f"; and {len(differences) - 4} more" if len(differences) > 4 else "")
    shapes = differences[0].startswith("model_type") or any(d.split("=")[0] in SHAPE_FIELDS for d in differences)
    if shapes:
        why = f"its config gives it tensors that differ in names, dtypes or shapes ({listed})"
    else:
        why = f"its config computes something else ({listed})"
    raise CheckpointError(
        f"{directory} holds adapter experts trained on another model than the base {name}: {why}. Loading them on "
        "it would give a model that was never trained. Pass the base they were converted from: from_pretrained(dir, "
        "base=PATH_OR_MODEL), or restore that base's config.json."
    )


def config_differences(recorded: dict, found: dict, prefix: str = "") -> list[str]:
    """`field=found value in the base, recorded value recorded` for each field of two config dicts that changes the
    computation (all but `NOT_COMPUTED` and private ones; sub-configs field by field)."""
    differences = []
    for key in sorted(set(recorded) | set(found)):
        if key in NOT_COMPUTED or key.startswith("_"):  # (private fields are transformers' bookkeeping)
            continue
        ours, theirs = recorded.get(key, _ABSENT), found.get(key, _ABSENT)
        if isinstance(ours, dict) and isinstance(theirs, dict) and key.endswith("_config"):
            differences += config_differences(ours, theirs, f"{prefix}{key}.")
        elif ours != theirs:
            differences.append(f"{prefix}{key}={_brief(theirs)} in the base, {_brief(ours)} recorded")
    return differences


def base_name(config, base) -> str:
    if isinstance(base, (str, os.PathLike)):
        return os.fspath(base)
    if base is not None:
        return "(the model passed as base)"
    return str((config.adapter_experts.get("base_model") or {}).get("name_or_path"))


def _check_model_object(base: nn.Module, directory: str) -> None:
    from transformers import PreTrainedModel

    if not isinstance(base, PreTrainedModel):
        raise TypeError(f"base= takes a path, a Hub id or the dense model (a PreTrainedModel), not a "
                        f"{type(base).__name__}.")
    if getattr(base.config, "model_type", None) == "hf_moe":
        raise CheckpointError(
            f"{directory} holds adapter experts; the model passed as base is already an hf_moe model. Pass the dense "
            "model they were converted from (or its path): from_pretrained(dir, base=PATH_OR_MODEL)."
        )


def _copy(base: nn.Module, directory: str) -> nn.Module:
    """A copy of the caller's dense model, which the load turns into the adapter model: theirs stays as it was."""
    size = sum(t.numel() * t.element_size() for t in (*base.parameters(), *base.buffers()) if t.device.type == "cpu")
    available = available_memory()
    if available is not None and size > available:
        raise ValueError(
            f"Loading {directory} onto the model passed as base copies it ({format_bytes(size)} of its tensors in host "
            f"memory), but {format_bytes(available)} is available. Save the dense model and pass its path instead: "
            "from_pretrained(dir, base=PATH) loads it once."
        )
    return copy.deepcopy(base)


def _brief(value: Any, limit: int = 200) -> str:
    text = repr(value) if value is not _ABSENT else _ABSENT
    return text if len(text) <= limit else f"{text[: limit - 25]}... ({len(text)} characters)"


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
    digests = {}
    reference = {"name_or_path": name, "dtype": dtype_name, **base_fingerprint(model, digests)}
    record_digests(model, digests)  # (what its saves compare the frozen tensors with)
    return reference


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
        weight_map, metadata = read_index(directory)
        frozen = _frozen_keys(metadata, weight_map, directory)
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
    digests = _check_fingerprint(model, config, directory, base)
    cast = dtype if dtype not in (None, "auto") else None
    loaded = str(next(model.parameters()).dtype).removeprefix("torch.")
    if cast is None and config.dtype is not None and str(config.dtype) != loaded:
        cast = getattr(torch, str(config.dtype).removeprefix("torch."))
    if cast is not None:
        model.to(cast)
        _adapters_in_fp32(model)
        digests = None  # (the base in this dtype is what a save compares with: read again below)
    record_digests(model, digests)  # (before the saved tensors are loaded over the base)
    result = model.load_state_dict(tensors, strict=False)
    if result.unexpected_keys:  # (validate_checkpoint has checked every key against the config: never expected)
        raise CheckpointError(f"{directory} holds tensors this model has no place for: {result.unexpected_keys[:5]}.")
    paths = list(adapter_blocks(model))
    extra = {k for k in tensors if not always_saved(k, paths)} - frozen  # what the user had unfrozen stays trainable
    for name, param in model.named_parameters():
        if name in extra:
            param.requires_grad_(True)
    model.config.name_or_path = directory
    return model.eval()


def _frozen_keys(metadata: dict, weight_map: dict, directory: str) -> set[str]:
    """The index's `frozen`: the keys saved although frozen (`saved_state_dict`), as their current names."""
    frozen = metadata.get("frozen", [])
    if not (isinstance(frozen, list) and all(isinstance(k, str) and k in weight_map for k in frozen)):
        raise CheckpointError(
            f"{directory}/{INDEX_NAME} is corrupt: its metadata.frozen is not a list of the keys it maps. Save the "
            "model again."
        )
    return {current_key(k) for k in frozen}


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


def _check_fingerprint(model: nn.Module, config, directory: str, base) -> dict[str, str] | None:
    ref = config.adapter_experts.get("base_model") or {}
    if not ref.get("fingerprint"):
        return None  # (converted on the meta device: nothing was recorded)
    digests = {}
    found = base_fingerprint(model, digests)
    if found["fingerprint"] == ref["fingerprint"]:
        return digests  # (each frozen tensor's digest: see `fingerprint.record_digests`)
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
