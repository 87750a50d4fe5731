"""The base model of an adapter-expert checkpoint: where it is, and whether it is the one the adapters were trained on.

An adapter checkpoint holds only what was trained; the rest of the model is the base's. The base is identified by
everything that changes what it computes: its weights (the fingerprint, `adapter_experts.base_model`, checked in
`adapter_experts._check_fingerprint`) and its config, which the checkpoint's config holds whole (an hf_moe config is
the base config plus the MoE fields). Every field of the base config counts except those in `NOT_COMPUTED`, so a
field added by a later transformers (or a family's own) is part of the identity by default. The config is compared
before a weight of the base is read, so a base whose config gives other shapes (`num_key_value_heads`) is hf_moe's
error, not a size mismatch inside transformers.

Where the base is: `base=` (a directory, a Hub id, or the dense model itself, which is copied, never changed), else
the recorded `name_or_path`; a relative recorded path names a directory relative to the checkpoint.
"""

from __future__ import annotations

import copy
import errno
import os
import re
from typing import Any

import torch
from torch import nn

from ..checkpoint import HUB_KWARGS, CheckpointError
from .estimate import available_memory, format_bytes

# Base config fields that do not change what the model computes: bookkeeping, output switches, the token ids of the
# tokenizer and of generation (not read by the forward), initialisation (the weights are loaded), a choice made at
# load (attention and experts implementations) and the dtype (the fingerprint holds the weights' dtype).
NOT_COMPUTED = frozenset({
    "_name_or_path", "name_or_path", "architectures", "transformers_version", "auto_map", "model_type", "dtype",
    "torch_dtype", "attn_implementation", "_attn_implementation", "experts_implementation", "_experts_implementation",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript", "bos_token_id",
    "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "tokenizer_class", "prefix",
    "task_specific_params", "finetuning_task", "id2label", "label2id", "problem_type", "initializer_range", "init_std",
    "initializer_factor", "chunk_size_feed_forward",
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
