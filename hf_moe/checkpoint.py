"""Per-expert safetensors checkpoints: layout, atomic save, and checks before load.

Layout of a saved directory:

    config.json, generation_config.json, README.md (model card)
    model-00001-of-0000N.safetensors              every non-expert tensor (embeddings, attention, routers, ...)
    model-expert-00000.safetensors                expert 0 of every MoE layer
    ...
    model-expert-000{E-1}.safetensors             (an expert's file is split as model-expert-00003-00001-of-00002
                                                   past `max_shard_size`)
    model.safetensors.index.json                  the standard index: every key -> its file

In memory, an MoE layer's experts are fused 3-D parameters (`...mlp.experts.gate_up_proj` [E, 2I, H]). On
disk each expert has its own keys: `...mlp.experts.{e}.gate_up_proj` [2I, H]. Nothing depends on how many
processes wrote or will read the files. Loading goes through transformers' `from_pretrained`, with a weight
conversion (registered in `hf_moe/__init__.py`) that stacks the per-expert tensors back.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
import uuid
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .compat import convert_file_size_to_int, remove_tied_weights_from_state_dict
from .configuration import CHECKPOINT_FORMAT_VERSION
from .layers import Experts
from .model_card import is_generated_card, render_model_card

INDEX_NAME = "model.safetensors.index.json"
EXPERT_FILE_PREFIX = "model-expert-"
EXPERT_PARAM_NAMES = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<name>\w+)$")


class CheckpointError(ValueError):
    """A saved MoE checkpoint is incomplete, corrupt, or from an unsupported version."""


# --------------------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------------------
def save_checkpoint(
    model,
    save_directory: str | os.PathLike,
    *,
    is_main_process: bool = True,
    state_dict: dict[str, torch.Tensor] | None = None,
    max_shard_size: int | str = "5GB",
) -> None:
    """Write `model` to `save_directory` in the per-expert layout.

    Atomic: everything is written to a hidden staging directory beside the target, which then takes the
    target's place. An interrupted save leaves the target as it was (or absent), never half-written. Files in an
    existing target that this save does not produce (a tokenizer, say) are kept; old weight files are not.

    With expert parallelism (DTensor parameters, or a `state_dict` of DTensors) every process must call it: each
    writes the files of the experts it stores (`parallel.shard.whole_local_experts`: no communication when FSDP2
    keeps experts whole, else its share of its block, gathered over "dp") and a share of the non-expert files,
    gathered one tensor at a time; rank 0 writes the index. No process gathers the model. The files are the same as a single process would write. Otherwise only `is_main_process` writes (a
    full `state_dict`, as Accelerate's FULL_STATE_DICT gathers it on rank 0, is written as it is).
    """
    sharded = _is_sharded(model, state_dict)
    if not sharded and not is_main_process:
        return
    target = Path(save_directory).absolute()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"Cannot save the model to {target}: it is a file, not a directory.")
    max_bytes = convert_file_size_to_int(max_shard_size)
    if sharded:
        _save_expert_parallel(model, target, state_dict, max_bytes)
        return
    shards = _plan_shards(checkpoint_state_dict(model, state_dict), max_bytes)
    staging = _new_staging(target)
    try:
        _finish(model, staging, target, [_write_shards(shards, staging)])
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _is_sharded(model, state_dict) -> bool:
    from torch.distributed.tensor import DTensor

    tensors = model.parameters() if state_dict is None else state_dict.values()
    return any(isinstance(t, DTensor) for t in tensors)


def _new_staging(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.hf_moe-tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def _write_shards(shards: dict[str, dict[str, torch.Tensor]], staging: Path) -> dict[str, str]:
    """Write the shard files; {key: filename} of what was written."""
    weight_map = {}
    for filename, tensors in tqdm(shards.items(), desc="Saving per-expert shards", unit="file", leave=False):
        save_file({k: t.contiguous() for k, t in tensors.items()}, staging / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
    return weight_map


def _finish(model, staging: Path, target: Path, weight_maps: list[dict[str, str]]) -> None:
    """Index, config, generation config and model card into `staging`, then move it to `target`."""
    weight_map = {k: v for part in weight_maps for k, v in part.items()}
    total_size = total_parameters = 0
    for filename in set(weight_map.values()):
        for key, meta in read_safetensors_header(staging / filename).items():
            if key != "__metadata__":
                total_size += meta["data_offsets"][1] - meta["data_offsets"][0]
                total_parameters += math.prod(meta["shape"])
    index = {
        "metadata": {
            "total_size": total_size,
            "total_parameters": total_parameters,
            "format": "hf_moe",
            "hf_moe_format": CHECKPOINT_FORMAT_VERSION,
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = model.config
    config.architectures = [_architecture(model)]
    config.dtype = str(model.dtype).removeprefix("torch.")
    config.save_pretrained(staging)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(staging)
    (staging / "README.md").write_text(render_model_card(model))
    _commit(staging, target)


def _architecture(model) -> str:
    """The model's class name, without the FSDP2 wrapper class `fully_shard` puts in front of it."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def _save_expert_parallel(model, target: Path, state_dict, max_bytes: int) -> None:
    """The collective save of a sharded model (see `save_checkpoint`): one staging directory chosen by rank 0,
    every process's files in it, rank 0 commits only if every process succeeded. Every process returns (or
    raises) after the directory is in place (or discarded)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from .parallel.shard import whole_local_experts

    rank, world = dist.get_rank(), dist.get_world_size()
    main = rank == 0
    error, written, mine = None, {}, {}
    try:
        tensors = _local_state_dict(model, state_dict, whole_local_experts)
        for i, (name, group) in enumerate(sorted(_plan_shards(tensors, max_bytes).items())):
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
    staging_name = [str(_new_staging(target)) if main else None]
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
                raise RuntimeError(f"Saving {target} failed on rank(s) {[r for r, (ok, _) in enumerate(results) if not ok]}.")
            _finish(model, staging, target, [part for _, part in results])
            status[0] = "ok"
        except BaseException as err:
            shutil.rmtree(staging, ignore_errors=True)
            status[0] = f"{type(err).__name__}: {err}"
            if error is None:
                error = err
    dist.broadcast_object_list(status, src=0)
    if error is not None:
        raise error
    if status[0] != "ok":
        raise RuntimeError(f"Saving {target} failed on rank 0: {status[0]}")


def _local_state_dict(model, state_dict, whole_local_experts) -> dict[str, torch.Tensor]:
    """The tensors this process contributes, under on-disk keys: its share of the experts (per expert; see
    `whole_local_experts`) and every non-expert tensor as it is (DTensor or plain; `_save_expert_parallel` gathers)."""
    fused = {
        f"{module_name}.{name}": experts
        for module_name, experts in model.named_modules()
        if isinstance(experts, Experts)
        for name, _ in experts.named_parameters(recurse=False)
    }
    out = {}
    for key, tensor in _without_ignored(model, model.state_dict() if state_dict is None else state_dict).items():
        if key not in fused:
            out[key] = tensor
            continue
        local, ids = whole_local_experts(fused[key], tensor)
        head, _, name = key.rpartition(".")
        out.update({f"{head}.{e}.{name}": local[i] for i, e in enumerate(ids)})
    return out


def checkpoint_state_dict(model, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The tensors to save under their on-disk keys: fused expert parameters split per expert (as views), tied
    duplicates and `_keys_to_ignore_on_save` removed."""
    if state_dict is None:
        state_dict = model.state_dict()
    return split_experts(_without_ignored(model, state_dict), model)


def _without_ignored(model, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` without tied duplicates and `_keys_to_ignore_on_save`."""
    state_dict = dict(state_dict)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state_dict.pop(key, None)
    return remove_tied_weights_from_state_dict(state_dict, model)


def split_experts(state_dict: dict[str, torch.Tensor], module, prefix: str = "") -> dict[str, torch.Tensor]:
    """`state_dict` (of `module`, its keys preceded by `prefix`) with every fused expert tensor [E, ...] of the
    module's `Experts` split per expert as views: `...experts.up_proj` -> `...experts.{e}.up_proj`, e counted from
    the module's first expert (not 0 for a block of experts held under expert parallelism)."""
    offsets = {  # fused key -> (global id of the first expert of a block, experts in all)
        f"{prefix}{module_name}.{param_name}": (experts.expert_offset, experts.num_experts)
        for module_name, experts in module.named_modules()
        if isinstance(experts, Experts)
        for param_name, _ in experts.named_parameters(recurse=False)
    }
    out = {}
    for key, tensor in state_dict.items():
        if key in offsets:
            head, _, name = key.rpartition(".")
            first, total = offsets[key]
            first = 0 if tensor.shape[0] == total else first  # all the experts (a gathered state_dict), or a block
            out.update({f"{head}.{first + e}.{name}": tensor[e] for e in range(tensor.shape[0])})
        else:
            out[key] = tensor
    return out


def fused_key(key: str) -> str:
    """The in-memory name of an on-disk key: `...experts.3.up_proj` -> `...experts.up_proj`; others unchanged."""
    match = _EXPERT_KEY.match(key)
    return f"{match['prefix']}.{match['name']}" if match else key


def _plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> dict[str, dict[str, torch.Tensor]]:
    """{filename: {on-disk key: tensor}}: non-expert tensors in model-*.safetensors, one file per expert."""
    common: dict[str, torch.Tensor] = {}
    per_expert: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, tensor in tensors.items():
        match = _EXPERT_KEY.match(key)
        if match:
            per_expert[int(match["expert"])][key] = tensor
        else:
            common[key] = tensor

    shards = {}
    groups = _split_by_size(common, max_bytes)
    for i, group in enumerate(groups):
        shards[f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"] = group
    for e in sorted(per_expert):
        groups = _split_by_size(per_expert[e], max_bytes)
        for i, group in enumerate(groups):
            suffix = "" if len(groups) == 1 else f"-{i + 1:05d}-of-{len(groups):05d}"
            shards[f"{EXPERT_FILE_PREFIX}{e:05d}{suffix}.safetensors"] = group
    return shards


def _split_by_size(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors, key=_natural_key):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][key] = tensors[key]
        size += nbytes
    return groups


def _natural_key(key: str):
    return [int(part) if part.isdigit() else part for part in key.split(".")]


def _is_weight_file(name: str) -> bool:
    return name.endswith((".safetensors", ".safetensors.index.json")) or re.fullmatch(
        r"pytorch_model.*\.bin(\.index\.json)?", name
    ) is not None


def _commit(staging: Path, target: Path) -> None:
    """Move the finished staging directory to `target`, keeping the target's unrelated files."""
    if target.exists():
        produced = {p.name for p in staging.iterdir()}
        for item in target.iterdir():
            if item.name == "README.md" and not is_generated_card(item.read_text(errors="replace")):
                (staging / "README.md").unlink()  # the user's own README wins over our card
            elif item.name in produced or _is_weight_file(item.name):
                continue
            _link_or_copy(item, staging / item.name)
        backup = target.parent / f".{target.name}.hf_moe-old-{uuid.uuid4().hex[:8]}"
        os.rename(target, backup)
        os.rename(staging, target)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.rename(staging, target)


def _link_or_copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=_link_or_copy_file)
    else:
        _link_or_copy_file(src, dst)


def _link_or_copy_file(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


# --------------------------------------------------------------------------------------------------------------
# Checks before load
# --------------------------------------------------------------------------------------------------------------
def read_safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a safetensors file, after checking that the file holds all the data it declares."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path.name} is corrupt: it is {size} bytes, too short for a safetensors file.")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise CheckpointError(f"{path.name} is corrupt: its header is cut off (truncated file?).")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path.name} is corrupt: its header is not valid JSON ({err}).") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end != size:
        raise CheckpointError(
            f"{path.name} is corrupt: its header declares {8 + header_len + end} bytes but the file has {size} "
            "(truncated or partly overwritten)."
        )
    return header


def expected_expert_keys(config) -> dict[str, int]:
    """{on-disk key: expert index} of every expert tensor the config calls for."""
    names = ["gate_up_proj" if config.expert_glu else "up_proj", "down_proj"]
    if config.expert_bias:
        names += [f"{n}_bias" for n in names]
    keys = {}
    for layer in config.moe_layers:
        prefix = f"{config.decoder_layers_path}.{layer}.{config.moe_block_path}.experts"
        for e in range(config.num_experts):
            keys.update({f"{prefix}.{e}.{name}": e for name in names})
    return keys


def validate_checkpoint(directory: str | os.PathLike) -> None:
    """Check a saved MoE directory before loading it: config, format version, index, every file, every key.

    Raises `CheckpointError` (or `FileNotFoundError`) naming the missing or corrupt file and what to do.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{directory} has no config.json, so it is not a saved model. Save one with model.save_pretrained(), "
            "or convert a dense model with `hf-moe convert SRC OUT`."
        )
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if model_type != "hf_moe":
        raise CheckpointError(
            f"{directory} holds a dense `{model_type}` model, not an hf_moe one. Convert it first: "
            f"`hf_moe.convert_to_moe({str(directory)!r}, num_experts=8, top_k=2)` or `hf-moe convert`."
        )
    fmt = config.get("hf_moe_format")
    if fmt is None or fmt > CHECKPOINT_FORMAT_VERSION:
        from . import __version__

        raise CheckpointError(
            f"{directory} was written with checkpoint format {fmt}, which hf_moe {__version__} cannot read "
            f"(it reads format 1 to {CHECKPOINT_FORMAT_VERSION}). Upgrade hf_moe: `pip install -U hf-moe`."
        )

    index_path = directory / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index_path} is corrupt ({err}). Save the model again.") from None
    elif (directory / "model.safetensors").is_file():
        header = read_safetensors_header(directory / "model.safetensors")
        weight_map = dict.fromkeys((k for k in header if k != "__metadata__"), "model.safetensors")
    else:
        raise FileNotFoundError(f"{directory} has a config but no weights ({INDEX_NAME} or model.safetensors).")

    files = defaultdict(list)
    for key, filename in weight_map.items():
        files[filename].append(key)
    missing_files = sorted(f for f in files if not (directory / f).is_file())
    if missing_files:
        raise CheckpointError(
            f"{directory} is incomplete: {len(missing_files)} weight file(s) listed in {INDEX_NAME} are missing: "
            f"{', '.join(missing_files)}. Copy them back, or save the model again."
        )
    for filename, keys in files.items():
        header = read_safetensors_header(directory / filename)
        absent = [k for k in keys if k not in header]
        if absent:
            raise CheckpointError(
                f"{filename} is corrupt or was replaced: it lacks {len(absent)} tensor(s) the index lists, e.g. "
                f"{absent[0]}. Save the model again."
            )

    from .configuration import MoEConfig

    expected = expected_expert_keys(MoEConfig.from_dict(config))
    missing = [k for k in expected if k not in weight_map]
    if missing:
        experts = sorted({expected[k] for k in missing})
        names = ", ".join(f"model-expert-{e:05d}*.safetensors" for e in experts[:8])
        raise CheckpointError(
            f"{directory} is incomplete: {len(missing)} expert tensor(s) are missing (e.g. {missing[0]}), from "
            f"expert(s) {experts} — expected in {names}. Save the model again."
        )


@contextlib.contextmanager
def local_expert_view(directory: str | os.PathLike, start: int, end: int):
    """A temporary directory that looks like `directory` but lists only the non-expert tensors and experts
    [start, end): config and small files are copied, weight files linked, and the index filtered. Loading from it
    reads nothing of the other experts."""
    directory = Path(directory).absolute()
    index = json.loads((directory / INDEX_NAME).read_text())
    keep = {}
    for key, filename in index["weight_map"].items():
        match = _EXPERT_KEY.match(key)
        if match is None or start <= int(match["expert"]) < end:
            keep[key] = filename
    with tempfile.TemporaryDirectory(prefix="hf_moe-view-") as tmp:
        view = Path(tmp)
        for item in directory.iterdir():
            if item.name == INDEX_NAME or item.is_dir():
                continue
            if item.name.endswith(".safetensors"):
                if item.name in set(keep.values()):
                    os.symlink(item, view / item.name)
            else:
                shutil.copy2(item, view / item.name)
        (view / INDEX_NAME).write_text(json.dumps({"metadata": index.get("metadata", {}), "weight_map": keep}))
        yield str(view)


def missing_keys_error(directory, missing_keys) -> CheckpointError:
    """The error for tensors the model needs that the checkpoint does not have."""
    shown = ", ".join(sorted(missing_keys)[:5])
    return CheckpointError(
        f"{directory} lacks {len(missing_keys)} tensor(s) the model needs ({shown}"
        f"{', ...' if len(missing_keys) > 5 else ''}); they are normally in the model-0000*-of-*.safetensors "
        "files. The checkpoint is incomplete or from another model: save it again."
    )


# --------------------------------------------------------------------------------------------------------------
# Load into an existing model (Trainer resume)
# --------------------------------------------------------------------------------------------------------------
def load_checkpoint(model, directory: str | os.PathLike, strict: bool = True):
    """Load a per-expert checkpoint into `model` in place, one file at a time.

    Returns torch's `_IncompatibleKeys(missing_keys, unexpected_keys)` in on-disk key names; with `strict`, raises
    instead when either is non-empty. This is what `transformers.Trainer` uses to resume (see
    `hf_moe.training.trainer_compat`). A sharded model (DTensor parameters) is refused: see the error.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    if _is_sharded(model, None):
        raise CheckpointError(
            f"Cannot load {directory} into a sharded model (DTensor parameters, from hf_moe.parallelize or "
            "expert_parallel) tensor by tensor. Load it with MoEForCausalLM.from_pretrained(path, "
            "expert_parallel=True) (each process reads its own experts) and call hf_moe.parallelize; to resume "
            "training, use hf_moe.MoETrainer, whose checkpoints hold a resharding DCP training state."
        )
    validate_checkpoint(directory)
    weight_map = json.loads((directory / INDEX_NAME).read_text())["weight_map"]
    expected = set(checkpoint_state_dict(model))
    missing = sorted(expected - set(weight_map))
    unexpected = sorted(set(weight_map) - expected)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{directory} does not match {type(model).__name__}: {len(missing)} missing tensor(s) "
            f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}."
        )
    for filename in sorted(set(weight_map.values())):
        model.load_state_dict(load_file(directory / filename), strict=False)
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)
