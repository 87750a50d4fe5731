"""`save_checkpoint`: a model written in the per-expert layout, with checksums, committed atomically (commit.py)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from ..compat import convert_file_size_to_int
from ..layers.quantized import QuantizedExperts
from ..layers.quantized_linear import QuantizedLinear
from ..model_card import render_model_card
from ..ops.int8 import bad_scales, scale_limit
from .checksums import checksum_files, config_checksums
from .commit import commit, discard, nested_directories, new_staging, resolve_output_directory, staging_directory
from .fingerprint import saved_state_dict
from .format import (
    CHECKPOINT_FORMAT_VERSION, CHECKSUM_ALGORITHM, EXPERT_FILE_PREFIX, INDEX_NAME, PACKAGE_FIELD, PACKAGE_NOTE,
)
from .layout import checkpoint_state_dict, local_state_dict, plan_shards
from .snapshot import check_not_reading


def save_checkpoint(
    model,
    save_directory: str | os.PathLike,
    *,
    is_main_process: bool = True,
    state_dict: dict[str, torch.Tensor] | None = None,
    max_shard_size: int | str = "5GB",
    extra=None,
) -> None:
    """Write `model` to `save_directory` in the per-expert layout, with a checksum of every file in the index.

    Atomic: everything is written to a hidden staging directory beside the target, which then takes the
    target's place in one rename. An interrupted save leaves the target as it was, never half-written, and the
    next save removes what it left. Files in an existing target that this save does not produce (a tokenizer,
    say) are kept; old weight files are not. A symbolic link as `save_directory` is followed: the directory it
    points to is replaced, and the link stays.

    With expert parallelism (DTensor parameters, or a `state_dict` of DTensors) every process must call it: each
    writes the files of the experts it stores (`layout.whole_local_experts`: no communication when FSDP2
    keeps experts whole, else its share of its block, gathered over "dp") and a share of the non-expert files,
    gathered one tensor at a time; rank 0 writes the index. No process gathers the model. The files are the same as a
    single process would write. Otherwise only `is_main_process` writes (a full `state_dict`, as Accelerate's
    FULL_STATE_DICT gathers it on rank 0, is written as it is).

    `extra(staging)`, if given, writes more files into the checkpoint before the commit (a tokenizer): they appear
    with the model, atomically.

    A model with adapter experts (`config.adapter_experts`) writes only what was trained: the routers and adapters,
    and any other parameter that requires grad; the config names the base checkpoint the rest comes from. A frozen
    tensor that is no longer the base's (a merged PEFT LoRA) is written too (`fingerprint.saved_state_dict`).
    """
    frozen = []
    if getattr(model.config, "adapter_experts", None) is not None:  # what was trained; the rest is the base's, unless
        state_dict, frozen = saved_state_dict(model, state_dict)  # the frozen weights changed (a merged LoRA)
    sharded = is_sharded(model, state_dict)
    if not sharded and not is_main_process:
        return
    target = resolve_output_directory(save_directory, "Cannot save the model to")
    _check_not_over_base(model, target)
    check_not_reading(target)  # (before writing anything: the commit could never swap it in)
    max_bytes = convert_file_size_to_int(max_shard_size)
    if sharded:
        _save_expert_parallel(model, target, state_dict, max_bytes, extra)
        return
    _check_int8_scales(model)
    shards = plan_shards(checkpoint_state_dict(model, state_dict), max_bytes)
    with staging_directory(target) as staging:
        finish(model, staging, target, [_write_shards(shards, staging)], extra, frozen=frozen)


def _check_not_over_base(model, target: Path) -> None:
    """An adapter model is never saved into the base directory its checkpoint refers to, inside it, or into one that
    holds it: the commit would replace (or write among) the weights the checkpoint needs."""
    spec = getattr(model.config, "adapter_experts", None)
    base = spec.get("base_model") if isinstance(spec, dict) else None
    path = base.get("name_or_path") if isinstance(base, dict) else None
    if isinstance(path, str) and os.path.isdir(path) and nested_directories(target, path):
        raise ValueError(
            f"Cannot save the adapter model to {target}: it is, holds or lies inside its base model {path}, whose "
            "weights the checkpoint refers to; saving there would replace them or write among them. Nothing was "
            "written: choose another directory."
        )


def _check_int8_scales(model) -> None:
    """The scales of int8 experts and linear layers (`hf_moe.quantize_experts`) are sound (finite, >= 0, within
    `scale_limit`), or nothing is written: a NaN, an infinity or a negative scale computes non-finite (or sign-flipped)
    outputs wherever it is used, and every load refuses it. They come from quantizing weights that were not finite (a
    diverged run)."""
    for name, module in model.named_modules():
        if isinstance(module, QuantizedExperts):
            scales = [(n, b, getattr(module, n.removesuffix("_scale")).shape[-1])
                      for n, b in module.named_buffers(recurse=False) if n.endswith("_scale")]
        elif isinstance(module, QuantizedLinear):
            scales = [("weight_scale", module.weight_scale, module.in_features)]
        else:
            continue
        for buffer_name, scale, in_features in scales:
            bad = bad_scales(scale, in_features)
            if bad:
                raise ValueError(
                    f"{name}.{buffer_name} holds {bad} NaN, infinite, negative or too large int8 scale(s) of "
                    f"{scale.numel()} (at most {scale_limit(in_features):.3g} for rows of {in_features} inputs): the "
                    "weights were quantized from values that were not finite (or the scales were edited). Nothing "
                    "was written. Quantize a model with finite weights (an earlier checkpoint)."
                )


def is_sharded(model, state_dict) -> bool:
    tensors = model.parameters() if state_dict is None else state_dict.values()
    return any(isinstance(t, DTensor) for t in tensors)


def _write_shards(shards: dict[str, dict[str, torch.Tensor]], staging: Path) -> dict[str, str]:
    """Write the shard files; {key: filename} of what was written. Each gets the mode the umask gives a new file (as
    the config and the index do): safetensors (0.8) writes its files 0600, which other users could not read."""
    weight_map = {}
    mode = _file_mode(staging)
    for filename, tensors in tqdm(shards.items(), desc="Saving per-expert shards", unit="file", leave=False):
        save_file({k: t.contiguous() for k, t in tensors.items()}, staging / filename, metadata={"format": "pt"})
        os.chmod(staging / filename, mode)
        weight_map.update(dict.fromkeys(tensors, filename))
    return weight_map


def _file_mode(staging: Path) -> int:
    """The mode a new file gets under this process's umask: the staging directory was made with 0o777 less the
    umask (read without `os.umask`, which sets it for every thread while it reads it)."""
    return 0o666 & os.stat(staging).st_mode


def finish(model, staging: Path, target: Path, weight_maps: list[dict[str, str]], extra=None, frozen=()) -> None:
    """Config (with `format.PACKAGE_NOTE`, and no `auto_map`), generation config, index (with the checksums of every
    weight file and of those two), model card, and `extra(staging)`'s files (a tokenizer: see `convert_checkpoint`)
    into `staging`, then move it to `target`. `frozen`: the saved keys of an adapter-expert model that a load keeps
    frozen (in the index's metadata; see `fingerprint.saved_state_dict`)."""
    config = model.config
    config.architectures = [_architecture(model)]
    config.dtype = str(model.dtype).removeprefix("torch.")
    config.__dict__.pop("auto_map", None)  # (loaded from a checkpoint an older hf_moe saved: see format.py)
    setattr(config, PACKAGE_FIELD, dict(PACKAGE_NOTE))
    config.save_pretrained(staging)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(staging)
    weight_map = {k: v for part in weight_maps for k, v in part.items()}
    total_size = total_parameters = 0
    checksums = {}
    for filename, header, record in checksum_files(staging, sorted(set(weight_map.values())), "Recording checksums"):
        checksums[filename] = record
        for key, meta in header.items():
            if key != "__metadata__":
                total_size += meta["data_offsets"][1] - meta["data_offsets"][0]
                total_parameters += math.prod(meta["shape"])
    index = {
        "metadata": {
            "total_size": total_size,
            "total_parameters": total_parameters,
            "format": "hf_moe",
            "hf_moe_format": CHECKPOINT_FORMAT_VERSION,
            "checksums": {
                "algorithm": CHECKSUM_ALGORITHM, "files": checksums, "config_files": config_checksums(staging),
            },
            **({"frozen": sorted(frozen)} if frozen else {}),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (staging / "README.md").write_text(render_model_card(model))
    if extra is not None:
        extra(staging)
    commit(staging, target)


def _architecture(model) -> str:
    """The model's class name, without the FSDP2 wrapper class `fully_shard` puts in front of it."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def _save_expert_parallel(model, target: Path, state_dict, max_bytes: int, extra=None) -> None:
    """The collective save of a sharded model (see `save_checkpoint`): one staging directory chosen by rank 0,
    every process's files in it, rank 0 commits only if every process succeeded. Every process returns (or
    raises) after the directory is in place (or discarded)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    main = rank == 0
    error, written, mine = None, {}, {}
    try:
        tensors = local_state_dict(model, state_dict)
        for i, (name, group) in enumerate(sorted(plan_shards(tensors, max_bytes).items())):
            if name.startswith(EXPERT_FILE_PREFIX):  # this process's own experts
                mine[name] = group
                continue
            writer = i % world == rank  # non-expert files take turns; each tensor is gathered by all, kept by one
            full = {}
            for key, tensor in group.items():
                tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # collective: all ranks
                if writer:
                    full[key] = tensor
            if writer:
                mine[name] = full
    except BaseException as err:  # no collective may be skipped by one process only: fail everywhere
        error = err
    staging_name = [str(new_staging(target)) if main else None]
    dist.broadcast_object_list(staging_name, src=0)
    staging = Path(staging_name[0])
    if error is None:
        try:
            written = _write_shards(mine, staging)
        except BaseException as err:  # the other ranks must still hear about it, or they wait forever
            error = err
    results: list = [None] * world
    dist.all_gather_object(results, (error is None, written))
    status = [None]
    if main:
        try:
            if not all(ok for ok, _ in results):
                failed = [r for r, (ok, _) in enumerate(results) if not ok]
                raise RuntimeError(f"Saving {target} failed on rank(s) {failed}.")
            finish(model, staging, target, [part for _, part in results], extra)
            status[0] = "ok"
        except BaseException as err:
            discard(staging)
            status[0] = f"{type(err).__name__}: {err}"
            if error is None:
                error = err
    dist.broadcast_object_list(status, src=0)
    if error is not None:
        raise error
    if status[0] != "ok":
        raise RuntimeError(f"Saving {target} failed on rank 0: {status[0]}")
