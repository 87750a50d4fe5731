"""Per-expert safetensors checkpoints: layout, checksums, atomic save, and checks before load.

Layout of a saved directory:

    config.json, generation_config.json, README.md (model card)
    model-00001-of-0000N.safetensors              every non-expert tensor (embeddings, attention, routers, ...)
    model-expert-00000.safetensors                expert 0 of every MoE layer
    ...
    model-expert-000{E-1}.safetensors             (an expert's file is split as model-expert-00003-00001-of-00002
                                                   past `max_shard_size`)
    model.safetensors.index.json                  the standard index: every key -> its file; its `metadata` holds
                                                  a content hash of every file (`checksums`, see below)

In memory, an MoE layer's experts are fused 3-D parameters (`...mlp.experts.gate_up_proj` [E, 2I, H]). On
disk each expert has its own keys: `...mlp.experts.{e}.gate_up_proj` [2I, H]. Nothing depends on how many
processes wrote or will read the files. Loading goes through transformers' `from_pretrained`, with a weight
conversion (registered in `hf_moe/__init__.py`) that stacks the per-expert tensors back.

Checksums (`index["metadata"]["checksums"]`): {"algorithm": "xxh3_128", "files": {file: {"size": bytes, "header":
hash of the 8-byte length and the JSON header, "tensors": {key: hash of its bytes}}}}. Every load checks the sizes
and the header hashes (a few KB per file); `verify_checksums=True` (or `hf-moe verify DIR`) hashes the data too and
names each file and tensor whose bytes changed. The cost is measured in benchmarks/checksums.py.

Staging and commit: a save writes into `.OUT.hf_moe-tmp-<token>` beside OUT while holding an exclusive `flock` on
`.OUT.hf_moe-<token>.lock`, then swaps it with OUT in one step (`renameat2(RENAME_EXCHANGE)`; where the platform
or filesystem lacks it, two renames through `.OUT.hf_moe-old-<token>`). Whatever a killed save leaves beside OUT
has a lock nobody holds: the next save into OUT removes it, and the next load or save puts back a model that a kill
between the two renames left hidden. A live writer holds its lock, so its staging is never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .compat import convert_file_size_to_int, remove_tied_weights_from_state_dict
from .configuration import CHECKPOINT_FORMAT_VERSION, _brief, _cut
from .layers import Experts
from .model_card import is_generated_card, render_model_card

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so stale staging is never removed (it cannot be told from live)
    fcntl = None

INDEX_NAME = "model.safetensors.index.json"
EXPERT_FILE_PREFIX = "model-expert-"
EXPERT_PARAM_NAMES = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<name>\w+)$")

# The dtypes of the safetensors format that torch has.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header
MAX_JSON_BYTES = 256 << 20  # config.json and the index
CHECKSUM_ALGORITHMS = {"xxh3_128": xxhash.xxh3_128, "blake2b": hashlib.blake2b, "sha256": hashlib.sha256}
CHECKSUM_ALGORITHM = "xxh3_128"  # 0.08 s/GB on one core, 8x faster than sha256 (benchmarks/checksums.py)
# Whether `from_pretrained` hashes the data of a checkpoint that records checksums, unless told otherwise (the
# sizes and headers are always checked). See benchmarks/checksums.py for the measured cost.
VERIFY_CHECKSUMS_BY_DEFAULT = True
_HASH_CHUNK = 1 << 20  # read and hashed while still in the CPU cache: 2x faster than 16 MB reads here
_MAX_PROBLEMS_SHOWN = 12


# `auto_map`: with it, `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loads the model in a
# process that never imported hf_moe (lm-eval, PEFT, serving scripts). The module it names is a shim written into
# the checkpoint that imports the installed hf_moe package, which registers the model type: no model code is copied.
AUTO_MAP_MODULE = "modeling_hf_moe"
AUTO_MAP = {"AutoConfig": f"{AUTO_MAP_MODULE}.MoEConfig", "AutoModelForCausalLM": f"{AUTO_MAP_MODULE}.MoEForCausalLM"}
AUTO_MAP_SHIM = '''"""Loads this hf_moe checkpoint with the installed hf_moe package (`pip install hf-moe`).

Written by hf_moe into every checkpoint it saves, so that
`AutoModelForCausalLM.from_pretrained(this_dir, trust_remote_code=True)` works in a process that never imported
hf_moe. It holds no model code: importing hf_moe registers the `hf_moe` model type with transformers.
"""

from hf_moe import MoEConfig, MoEForCausalLM

__all__ = ["MoEConfig", "MoEForCausalLM"]
'''


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
    """Write `model` to `save_directory` in the per-expert layout, with a checksum of every file in the index.

    Atomic: everything is written to a hidden staging directory beside the target, which then takes the
    target's place in one rename. An interrupted save leaves the target as it was, never half-written, and the
    next save removes what it left. Files in an existing target that this save does not produce (a tokenizer,
    say) are kept; old weight files are not. A symbolic link as `save_directory` is followed: the directory it
    points to is replaced, and the link stays.

    With expert parallelism (DTensor parameters, or a `state_dict` of DTensors) every process must call it: each
    writes the files of the experts it stores (`parallel.shard.whole_local_experts`: no communication when FSDP2
    keeps experts whole, else its share of its block, gathered over "dp") and a share of the non-expert files,
    gathered one tensor at a time; rank 0 writes the index. No process gathers the model. The files are the same as a single process would write. Otherwise only `is_main_process` writes (a
    full `state_dict`, as Accelerate's FULL_STATE_DICT gathers it on rank 0, is written as it is).
    """
    sharded = _is_sharded(model, state_dict)
    if not sharded and not is_main_process:
        return
    target = resolve_output_directory(save_directory, "Cannot save the model to")
    max_bytes = convert_file_size_to_int(max_shard_size)
    if sharded:
        _save_expert_parallel(model, target, state_dict, max_bytes)
        return
    shards = _plan_shards(checkpoint_state_dict(model, state_dict), max_bytes)
    with staging_directory(target) as staging:
        _finish(model, staging, target, [_write_shards(shards, staging)])


def resolve_output_directory(directory: str | os.PathLike, action: str = "Cannot write to") -> Path:
    """`directory` as an absolute path with symbolic links and `..` resolved, so that a link is followed (the
    directory it names is replaced, not the link) and two spellings of one directory compare equal."""
    target = Path(os.path.realpath(directory))
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{action} {target}: it is a file, not a directory.")
    return target


def same_directory(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one directory (after resolving links and `..`)."""
    return os.path.realpath(a) == os.path.realpath(b)


def _is_sharded(model, state_dict) -> bool:
    from torch.distributed.tensor import DTensor

    tensors = model.parameters() if state_dict is None else state_dict.values()
    return any(isinstance(t, DTensor) for t in tensors)


def _write_shards(shards: dict[str, dict[str, torch.Tensor]], staging: Path) -> dict[str, str]:
    """Write the shard files; {key: filename} of what was written."""
    weight_map = {}
    for filename, tensors in tqdm(shards.items(), desc="Saving per-expert shards", unit="file", leave=False):
        save_file({k: t.contiguous() for k, t in tensors.items()}, staging / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
    return weight_map


def _finish(model, staging: Path, target: Path, weight_maps: list[dict[str, str]]) -> None:
    """Index (with every file's checksums), config, generation config and model card into `staging`, then move it
    to `target`."""
    weight_map = {k: v for part in weight_maps for k, v in part.items()}
    total_size = total_parameters = 0
    checksums = {}
    for filename, header, record in _checksum_files(staging, sorted(set(weight_map.values())), "Recording checksums"):
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
            "checksums": {"algorithm": CHECKSUM_ALGORITHM, "files": checksums},
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = model.config
    config.architectures = [_architecture(model)]
    config.dtype = str(model.dtype).removeprefix("torch.")
    config.auto_map = dict(AUTO_MAP)
    config.save_pretrained(staging)
    (staging / f"{AUTO_MAP_MODULE}.py").write_text(AUTO_MAP_SHIM)
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
            _discard(staging)
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


# --------------------------------------------------------------------------------------------------------------
# Staging, commit, and what killed saves leave behind
# --------------------------------------------------------------------------------------------------------------
# Staging directories this process is writing: path -> (fd holding the flock, or None without locks; lock file;
# token). Released by `_commit` or `_discard`.
_HELD: dict[Path, tuple[int | None, Path, str]] = {}


@contextlib.contextmanager
def staging_directory(target: Path):
    """A fresh staging directory beside `target`, locked while the block runs; discarded if the block raises.
    The block ends with `_commit(staging, target)` (normally through `_finish`)."""
    staging = _new_staging(target)
    try:
        yield staging
    except BaseException:
        _discard(staging)
        raise
    finally:
        _release(staging)


def _sibling(target: Path, kind: str, token: str) -> Path:
    return target.parent / f".{target.name}.hf_moe-{kind}-{token}"


def _lock_path(target: Path, token: str) -> Path:
    return target.parent / f".{target.name}.hf_moe-{token}.lock"


def _new_staging(target: Path) -> Path:
    """Create and lock a staging directory beside `target`, after removing what killed saves into it left.

    The lock file is created (and locked) before the directory, and removed only once the directory is finished
    with (committed or being discarded), so a staging directory whose lock nobody holds belongs to no live writer.
    A cleaner may lock a new lock file in the instant between its creation and its locking, and remove it: the
    writer then finds its lock file gone and takes a new one.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(target)
    while True:
        token = uuid.uuid4().hex[:12]
        lock = _lock_path(target, token)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        locked = _try_lock(fd, blocking=True)
        if locked is not False and _still_linked(fd, lock):
            break
        os.close(fd)  # a cleaner removed it before we locked it: take another
    if locked is None:  # a filesystem without locks: nothing to hold (and no cleaner will touch it)
        os.close(fd)
        fd = None
    staging = _sibling(target, "tmp", token)
    try:
        staging.mkdir()
    except BaseException:
        _unlock(fd, lock)
        raise
    _HELD[staging] = (fd, lock, token)
    return staging


def _still_linked(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _try_lock(fd: int, blocking: bool) -> bool | None:
    """True: this process now holds the lock. False: another process holds it. None: the filesystem has no locks."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None
    return True


def _unlock(fd: int | None, lock: Path) -> None:
    """Remove the lock file, then release the lock (in that order: see `_new_staging`)."""
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
    if fd is not None:
        os.close(fd)


def _release(staging: Path) -> None:
    held = _HELD.pop(staging, None)
    if held is not None:
        _unlock(held[0], held[1])


def _discard(staging: Path) -> None:
    """Remove a staging directory this process created. Its lock goes first: that frees a descriptor for the
    removal (which may have failed for want of one), and should the removal fail, what remains is stale, for the
    next save to remove."""
    _release(staging)
    _remove_tree(staging)


def _remove_tree(path: Path) -> None:
    """`shutil.rmtree`, and where it could not (it holds a descriptor per directory level), a simpler walk."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    with contextlib.suppress(OSError):
        for name in os.listdir(path):
            child = path / name
            if child.is_dir() and not child.is_symlink():
                _remove_tree(child)
            else:
                child.unlink()
        path.rmdir()


def _leftovers(target: Path) -> dict[str, list[Path]]:
    """{token: paths} of the staging directories, backups and lock files beside `target`."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.hf_moe-(?:(?:tmp|old|export)-)?([0-9a-f]{{8,32}})(?:\.lock)?")
    try:
        names = os.listdir(target.parent)
    except OSError:
        return {}
    found: dict[str, list[Path]] = defaultdict(list)
    for name in names:
        match = pattern.fullmatch(name)
        if match:
            found[match[1]].append(target.parent / name)
    return found


def _claim_dead(target: Path, token: str) -> tuple[bool, int | None]:
    """(True, fd) with the token's lock now held by this process (fd None if it has no lock file) when its writer
    is gone; (False, None) when it is alive, or when this filesystem cannot tell."""
    if any(held[2] == token for held in _HELD.values()):
        return False, None
    try:
        fd = os.open(_lock_path(target, token), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return True, None  # no lock file: its writer is gone (or was an hf_moe without locks)
    except OSError:
        return False, None
    if _try_lock(fd, blocking=False):
        return True, fd
    os.close(fd)
    return False, None


def clean_stale_staging(target: str | os.PathLike) -> list[Path]:
    """Remove what killed saves into `target` left beside it (staging directories, backups, lock files), after
    putting back a model that a kill in the middle of a commit left hidden. Live writers' files are kept. Returns
    the paths removed."""
    target = Path(target)
    removed = []
    for token, paths in sorted(_leftovers(target).items()):
        dead, fd = _claim_dead(target, token)
        if not dead:
            continue
        try:
            _restore_backup(target, token)
            for path in paths:
                if path.name.endswith(".lock"):
                    continue
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                removed.append(path)
        finally:
            _unlock(fd, _lock_path(target, token))
    return removed


def _restore_backup(target: Path, token: str) -> bool:
    backup = _sibling(target, "old", token)
    if backup.is_dir() and not os.path.lexists(target):
        with contextlib.suppress(FileNotFoundError):
            os.rename(backup, target)
            return True
    return False


def recover_interrupted_commit(target: str | os.PathLike) -> bool:
    """If `target` is missing because a save was killed between the two renames of its commit (platforms without
    `RENAME_EXCHANGE`), put the previous model back. Returns whether it did."""
    target = Path(target)
    if os.path.lexists(target) or not target.parent.is_dir():
        return False
    for token in sorted(_leftovers(target)):
        if not _sibling(target, "old", token).is_dir():
            continue
        dead, fd = _claim_dead(target, token)
        if dead:
            try:
                if _restore_backup(target, token):
                    return True
            finally:
                if fd is not None:
                    os.close(fd)
    return False


def _commit(staging: Path, target: Path) -> None:
    """Move the finished staging directory to `target`, keeping the target's unrelated files.

    One atomic step where the platform allows it (`renameat2(RENAME_EXCHANGE)` swaps the two directories; the old
    model is then removed from the staging path). Elsewhere: target -> backup, staging -> target, and the next
    load or save puts the backup back if a kill fell between the two.
    """
    held = _HELD.get(staging)
    if os.path.lexists(target):
        _carry_unrelated(target, staging)
        if _exchange(staging, target):
            previous = staging  # the previous model, now at the staging path
        else:
            previous = _sibling(target, "old", held[2] if held else uuid.uuid4().hex[:12])
            os.rename(target, previous)
            try:
                os.rename(staging, target)
            except BaseException:
                os.rename(previous, target)
                raise
        _release(staging)  # first: should the removal fail (or be killed), the previous model is stale, not live
        _remove_tree(previous)
    else:
        os.rename(staging, target)
        _release(staging)


def _carry_unrelated(target: Path, staging: Path) -> None:
    """Link (or copy) into `staging` the target's files that this save does not produce: a tokenizer, training
    logs. Symbolic links are carried as links, never followed."""
    produced = {p.name for p in staging.iterdir()}
    for item in target.iterdir():
        if item.name == "README.md" and (
            not item.is_file() or item.is_symlink() or not is_generated_card(item.read_text(errors="replace"))
        ):
            (staging / "README.md").unlink(missing_ok=True)  # the user's own README wins over our card
        elif item.name in produced or _is_weight_file(item.name):
            continue
        _link_or_copy(item, staging / item.name)


def _link_or_copy(src: Path, dst: Path) -> None:
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy_file)
    else:
        _link_or_copy_file(src, dst)


def _link_or_copy_file(src, dst) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2():
    """libc's renameat2 (Linux, glibc >= 2.28), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically. False where the platform or the filesystem cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"Cannot swap {a} and {b}: {os.strerror(err)}")


# --------------------------------------------------------------------------------------------------------------
# Reading files of a checkpoint: names, JSON, safetensors headers, checksums
# --------------------------------------------------------------------------------------------------------------
_PLAIN_NAME = re.compile(r"[^/\\\x00]{1,255}")


def checkpoint_file(directory: str | os.PathLike, name, source: str) -> Path:
    """`directory / name` for a file name read from `source` (the index, say), after checking that it names a
    file of the directory: a plain name, not a path, and not a symbolic link out of the directory (except, in a
    Hugging Face Hub cache snapshot, into that repository's `blobs/`). A checkpoint reads nothing outside itself."""
    directory = Path(directory)
    if not isinstance(name, str) or not _PLAIN_NAME.fullmatch(name) or name in (".", ".."):
        raise CheckpointError(
            f"{source} names the file {_brief(name)}, which is not a plain file name in {directory}. A checkpoint "
            "reads nothing outside its directory: the file was tampered with, or written by a tool that does not "
            "follow the format. Refusing to load it."
        )
    path = directory / name
    if not stays_inside(directory, path):
        raise CheckpointError(
            f"{path} is a symbolic link to {os.path.realpath(path)}, outside the checkpoint directory. A checkpoint "
            "reads nothing outside its directory: copy the file in instead of linking it."
        )
    return path


def stays_inside(directory: str | os.PathLike, path: Path) -> bool:
    """Whether `path` (an entry of `directory`) is a file of the directory: not a symbolic link out of it (except,
    in a Hugging Face Hub cache snapshot, into that repository's `blobs/`)."""
    if not path.is_symlink():
        return True
    real, root = Path(os.path.realpath(path)), Path(os.path.realpath(directory))
    allowed = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    return any(real == base or base in real.parents for base in allowed)


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, or a `CheckpointError` that names the file."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise CheckpointError(f"{path} is {size} bytes, more than any {path.name} hf_moe writes: refusing to read it.")
    try:
        value = json.loads(path.read_bytes())
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(
            f"{path} is corrupt: not valid JSON ({_cut(str(err), 300)}). Save the model again."
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is corrupt: it holds a JSON {type(value).__name__}, not an object.")
    return value


def read_index(directory: str | os.PathLike) -> tuple[dict[str, str], dict]:
    """(weight_map, metadata) of the directory's index, checked: a map of tensor names to file names of the
    directory, and a metadata object."""
    directory = Path(directory)
    path = checkpoint_file(directory, INDEX_NAME, "the index")
    index = _read_json(path)
    weight_map, metadata = index.get("weight_map"), index.get("metadata", {})
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{path} is corrupt: its weight_map is {type(weight_map).__name__}, not an object mapping tensor names "
            "to files. Save the model again."
        )
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path} is corrupt: its metadata is {type(metadata).__name__}, not an object.")
    names = set()
    for key, name in weight_map.items():
        if not isinstance(name, str) or name not in names:
            checkpoint_file(directory, name, f"{INDEX_NAME} (for {_brief(key)})")
            names.add(name)
    return weight_map, metadata


def recorded_checksums(metadata: dict, source: str = INDEX_NAME) -> dict | None:
    """The index's `checksums` entry, checked (None if the checkpoint has none: saved by an older hf_moe)."""
    checksums = metadata.get("checksums")
    if checksums is None:
        return None

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{source} is corrupt: its checksums {what}. Save the model again.")

    if not isinstance(checksums, dict) or not isinstance(checksums.get("files"), dict):
        raise bad("are not an object with a `files` object")
    if checksums.get("algorithm") not in CHECKSUM_ALGORITHMS:
        raise bad(f"use the algorithm {_brief(checksums.get('algorithm'))}; hf_moe knows {sorted(CHECKSUM_ALGORITHMS)}")
    hex_digest = re.compile(r"[0-9a-f]{8,128}")
    for name, record in checksums["files"].items():
        if not (
            isinstance(record, dict)
            and isinstance(record.get("size"), int)
            and isinstance(record.get("header"), str)
            and hex_digest.fullmatch(record["header"])
            and isinstance(record.get("tensors"), dict)
            and all(isinstance(v, str) and hex_digest.fullmatch(v) for v in record["tensors"].values())
        ):
            raise bad(f"for {_brief(name)} are not {{size, header, tensors}} with hexadecimal digests")
    return checksums


def _read_header(path: Path) -> tuple[dict, bytes]:
    """(header, the bytes it was read from: its 8-byte length and the JSON), after checking the header entry by
    entry and that the file holds exactly the data it declares."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path.name} is corrupt: it is {size} bytes, too short for a safetensors file.")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise CheckpointError(f"{path.name} is corrupt: its header is cut off (truncated file?).")
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path.name} is corrupt: it declares a {header_len}-byte header (at most {MAX_HEADER_BYTES})."
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(
            f"{path.name} is corrupt: its header is not valid JSON ({_cut(str(err), 300)})."
        ) from None
    _check_header(path.name, header, size - 8 - header_len)
    return header, prefix + raw


def _check_header(name: str, header, data_size: int) -> None:
    """Every entry {"dtype", "shape", "data_offsets"} well-formed, its byte count that of its dtype and shape, and
    the entries tiling the data section exactly."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{name} is corrupt: {what}.")

    if not isinstance(header, dict):
        raise bad(f"its header is a JSON {type(header).__name__}, not an object")
    spans = []
    for key, meta in header.items():
        if key == "__metadata__":
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise bad("its __metadata__ is not an object of strings")
            continue
        if not isinstance(meta, dict) or set(meta) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"the header entry of {_brief(key)} is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise bad(f"{_brief(key)} has the dtype {_brief(dtype)}, which is not one of {sorted(SAFETENSORS_DTYPES)}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d for d in shape):
            raise bad(f"{_brief(key)} has the shape {_brief(shape)}, not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"{_brief(key)} has the data_offsets {_brief(offsets)}, not [begin, end]")
        nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise bad(
                f"{_brief(key)} ({dtype} {shape}) should take {nbytes} bytes, but its data_offsets span "
                f"{offsets[1] - offsets[0]}"
            )
        spans.append((offsets[0], offsets[1], key))
    spans.sort()
    end = 0
    for begin, stop, key in spans:
        if begin != end:
            raise bad(f"the data of {_brief(key)} starts at byte {begin}, not {end} (overlapping or gapped tensors)")
        end = stop
    if end != data_size:
        raise bad(
            f"its header declares {end} bytes of data but the file has {data_size} (truncated or partly "
            "overwritten)"
        )


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a safetensors file, after checking every entry and that the file holds exactly the data
    it declares."""
    return _read_header(Path(path))[0]


def file_checksums(path: str | os.PathLike, algorithm: str = CHECKSUM_ALGORITHM, progress=None) -> tuple[dict, dict]:
    """(header, {"size", "header", "tensors": {key: digest}}) of a safetensors file: the hash of its header bytes,
    and of each tensor's bytes. `progress(n)` is called with the bytes hashed."""
    path = Path(path)
    new = CHECKSUM_ALGORITHMS[algorithm]
    header, raw = _read_header(path)
    spans = sorted((m["data_offsets"][0], m["data_offsets"][1], k) for k, m in header.items() if k != "__metadata__")
    record = {"size": len(raw) + (spans[-1][1] if spans else 0), "header": new(raw).hexdigest(), "tensors": {}}
    buffer = memoryview(bytearray(min(_HASH_CHUNK, max((e - b for b, e, _ in spans), default=1) or 1)))
    with open(path, "rb", buffering=0) as f:
        f.seek(len(raw))
        for begin, end, key in spans:  # contiguous: `_check_header` saw to it
            digest, remaining = new(), end - begin
            while remaining:
                got = f.readinto(buffer[: min(remaining, len(buffer))])
                if not got:
                    raise CheckpointError(f"{path.name} ended while reading {key}: the file is truncated.")
                digest.update(buffer[:got])
                remaining -= got
            record["tensors"][key] = digest.hexdigest()
            if progress is not None:
                progress(end - begin)
    return header, record


def _checksum_files(directory: Path, names: list[str], desc: str, algorithm: str = CHECKSUM_ALGORITHM):
    """Yield (name, header, checksums) of each file, with a progress bar over the bytes."""
    total = sum((directory / n).stat().st_size for n in names if (directory / n).is_file())
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False) as bar:
        for name in names:
            header, record = file_checksums(directory / name, algorithm, progress=bar.update)
            yield name, header, record


def checksum_problems(directory: str | os.PathLike, checksums: dict, names=None) -> list[str]:
    """One line for each file (of `names`, default all recorded) whose bytes differ from those recorded at save
    time, and for each tensor in it whose bytes differ."""
    directory = Path(directory)
    records = checksums["files"]
    names = sorted(records) if names is None else list(names)
    problems = []
    present = []
    for name in names:
        try:
            path = checkpoint_file(directory, name, INDEX_NAME)
        except CheckpointError as err:
            problems.append(_cut(str(err), 400))
            continue
        if name not in records:
            problems.append(f"{name}: no checksum was recorded for it (it was added or renamed after the save)")
        elif not path.is_file():
            problems.append(f"{name}: missing")
        else:
            present.append(name)
    total = sum((directory / n).stat().st_size for n in present)
    with tqdm(total=total, unit="B", unit_scale=True, desc="Verifying checksums", leave=False) as bar:
        for name in present:
            record = records[name]
            try:
                header, actual = file_checksums(directory / name, checksums["algorithm"], progress=bar.update)
            except CheckpointError as err:
                problems.append(f"{name}: {_cut(str(err), 300)}")
                continue
            if actual["size"] != record["size"]:
                problems.append(f"{name}: {actual['size']} bytes, but {record['size']} were saved")
            if actual["header"] != record["header"]:
                problems.append(f"{name}: header differs from the saved one (names, dtypes, shapes or offsets)")
            for key, digest in record["tensors"].items():
                got = actual["tensors"].get(key)
                if got is None:
                    problems.append(f"{name}: tensor {key} is gone from the file")
                elif got != digest:
                    problems.append(f"{name}: tensor {key}: its bytes differ from the saved ones")
            for key in sorted(set(actual["tensors"]) - set(record["tensors"])):
                problems.append(f"{name}: tensor {_brief(key)} was not in the file when it was saved")
    return problems


def _problems_error(directory, problems: list[str], what: str) -> CheckpointError:
    shown = "\n".join(f"  - {p}" for p in problems[:_MAX_PROBLEMS_SHOWN])
    more = f"\n  ... and {len(problems) - _MAX_PROBLEMS_SHOWN} more" if len(problems) > _MAX_PROBLEMS_SHOWN else ""
    return CheckpointError(
        f"{directory} is corrupt: {len(problems)} problem(s) {what}:\n{shown}{more}\n"
        "Restore these files from a good copy, or save the model again. (`hf-moe verify DIR` lists them all.)"
    )


# --------------------------------------------------------------------------------------------------------------
# Checks before load
# --------------------------------------------------------------------------------------------------------------
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


def validate_checkpoint(directory: str | os.PathLike, *, verify_checksums: bool | None = False) -> None:
    """Check a saved MoE directory before loading it: config, format version, index, every file's name, size,
    header and header checksum, every key, every tensor's dtype and shape against the config, and that the routers
    hold finite numbers. Restores a model that a killed save left hidden.

    verify_checksums: also hash every file's data and compare with the checksums recorded at save time. None: do
        so when the checkpoint records checksums and `VERIFY_CHECKSUMS_BY_DEFAULT`; True: required (an error if
        none are recorded); False: not.
    Raises `CheckpointError` (or `FileNotFoundError`) naming the missing or corrupt file and what to do.
    """
    directory = Path(directory)
    recover_interrupted_commit(directory)
    config = _read_config(directory)
    if (directory / INDEX_NAME).exists() or os.path.islink(directory / INDEX_NAME):
        weight_map, metadata = read_index(directory)
        checksums = recorded_checksums(metadata)
    elif (directory / "model.safetensors").is_file():
        header = read_safetensors_header(checkpoint_file(directory, "model.safetensors", "the checkpoint"))
        weight_map, checksums = dict.fromkeys((k for k in header if k != "__metadata__"), "model.safetensors"), None
    else:
        raise FileNotFoundError(f"{directory} has a config but no weights ({INDEX_NAME} or model.safetensors).")

    headers = _check_files(directory, weight_map, checksums)
    moe_config = _moe_config(directory, config)
    _check_expert_keys(directory, moe_config, weight_map)
    try:
        expected = expected_tensors(moe_config)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError) as err:
        raise CheckpointError(
            f"{directory}/config.json describes no model that can be built ({type(err).__name__}: "
            f"{_cut(str(err), 400)}). Restore it from a good copy."
        ) from None
    _check_tensors(weight_map, headers, expected, moe_config)
    _check_block_paths(directory, moe_config)
    _verify_data(directory, checksums, sorted(set(weight_map.values())), verify_checksums)
    _check_routers(directory, weight_map, expected, moe_config)  # (after: damage is named as damage, not as NaN)


def _verify_data(directory: Path, checksums: dict | None, names: list[str], verify_checksums: bool | None) -> None:
    """Hash the data of the files `names` against `checksums`, as `verify_checksums` says (see
    `validate_checkpoint`); raise with every problem found."""
    if verify_checksums is None:
        verify_checksums = VERIFY_CHECKSUMS_BY_DEFAULT and checksums is not None
    if not verify_checksums:
        return
    if checksums is None:
        raise CheckpointError(
            f"{directory} records no checksums (it was saved by an older hf_moe, or by another tool), so it cannot "
            "be verified. Load it with verify_checksums=False and save it again with this hf_moe to add them."
        )
    problems = checksum_problems(directory, checksums, names)
    if problems:
        raise _problems_error(directory, problems, "against the checksums recorded at save time")


def _read_config(directory: Path) -> dict:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{directory} has no config.json, so it is not a saved model. Save one with model.save_pretrained(), "
            "or convert a dense model with `hf-moe convert SRC OUT`."
        )
    config = _read_json(checkpoint_file(directory, "config.json", "the checkpoint"))
    model_type = config.get("model_type")
    if model_type != "hf_moe":
        raise CheckpointError(
            f"{directory} holds a dense `{_cut(str(model_type), 60)}` model, not an hf_moe one. Convert it first: "
            f"`hf_moe.convert_to_moe({str(directory)!r}, num_experts=8, top_k=2)` or `hf-moe convert`."
        )
    fmt = config.get("hf_moe_format")
    if type(fmt) is not int or not 1 <= fmt <= CHECKPOINT_FORMAT_VERSION:
        from . import __version__

        if type(fmt) is int and fmt > CHECKPOINT_FORMAT_VERSION:
            raise CheckpointError(
                f"{directory} was written with checkpoint format {fmt}, which hf_moe {__version__} cannot read "
                f"(it reads format 1 to {CHECKPOINT_FORMAT_VERSION}). Upgrade hf_moe: `pip install -U hf-moe`."
            )
        raise CheckpointError(
            f"{directory}/config.json has hf_moe_format={_brief(fmt)}, not a format number (1 to "
            f"{CHECKPOINT_FORMAT_VERSION}): the file is damaged, or was not written by hf_moe {__version__}."
        )
    return config


def _check_files(directory: Path, weight_map: dict[str, str], checksums: dict | None) -> dict[str, dict]:
    """{file: header} of every weight file, after checking that each exists, is well-formed, holds the keys the
    index lists, and (with checksums) has the size and header it was saved with."""
    files = defaultdict(list)
    for key, filename in weight_map.items():
        files[filename].append(key)
    missing_files = sorted(f for f in files if not (directory / f).is_file())
    if missing_files:
        raise CheckpointError(
            f"{directory} is incomplete: {len(missing_files)} weight file(s) listed in {INDEX_NAME} are missing: "
            f"{', '.join(missing_files[:8])}{', ...' if len(missing_files) > 8 else ''}. Copy them back, or save "
            "the model again."
        )
    headers = {}
    for filename, keys in files.items():
        header, raw = _read_header(checkpoint_file(directory, filename, INDEX_NAME))
        if checksums is not None:
            record = checksums["files"].get(filename)
            if record is None:
                raise CheckpointError(
                    f"{filename} has no checksum in {INDEX_NAME}: it was added after the save, or the index was "
                    "edited. Save the model again."
                )
            size = (directory / filename).stat().st_size
            if size != record["size"]:
                raise CheckpointError(
                    f"{filename} is corrupt: it is {size} bytes, but {record['size']} were saved. Restore it from a "
                    "good copy, or save the model again."
                )
            if CHECKSUM_ALGORITHMS[checksums["algorithm"]](raw).hexdigest() != record["header"]:
                raise CheckpointError(
                    f"{filename} is corrupt: its header (tensor names, dtypes, shapes, offsets) differs from the one "
                    "saved. Restore it from a good copy, or save the model again."
                )
        absent = [k for k in keys if k not in header]
        if absent:
            raise CheckpointError(
                f"{filename} is corrupt or was replaced: it lacks {len(absent)} tensor(s) the index lists, e.g. "
                f"{_brief(absent[0])}. Save the model again."
            )
        headers[filename] = header
    return headers


def checkpoint_config(directory: str | os.PathLike):
    """The MoEConfig of a saved checkpoint's config.json, read from inside the directory and checked (format,
    model type, every value), without reading any weight."""
    directory = Path(directory)
    return _moe_config(directory, _read_config(directory))


def _moe_config(directory: Path, config: dict):
    """The MoEConfig of config.json, or a `CheckpointError` that says which value is wrong."""
    from .configuration import MoEConfig

    try:
        return MoEConfig.from_dict(config)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as err:
        raise CheckpointError(f"{directory}/config.json is invalid: {_cut(str(err), 500)}") from None


def _check_expert_keys(directory: Path, config, weight_map: dict[str, str]) -> None:
    per_expert = 2 * (2 if config.expert_bias else 1)
    needed = len(config.moe_layers) * config.num_experts * per_expert
    if needed > len(weight_map):  # without listing them: num_experts may be absurd
        raise CheckpointError(
            f"{directory} is incomplete or its config.json is wrong: num_experts={config.num_experts} in "
            f"{len(config.moe_layers)} MoE layer(s) makes {needed} expert tensors, but {INDEX_NAME} lists "
            f"{len(weight_map)} tensors in all."
        )
    expected = expected_expert_keys(config)
    missing = [k for k in expected if k not in weight_map]
    if missing:
        experts = sorted({expected[k] for k in missing})
        names = ", ".join(f"model-expert-{e:05d}*.safetensors" for e in experts[:8])
        shown = f"{experts[:16]}{' ...' if len(experts) > 16 else ''}"
        raise CheckpointError(
            f"{directory} is incomplete: {len(missing)} expert tensor(s) are missing (e.g. {missing[0]}), from "
            f"{len(experts)} expert(s) {shown} — expected in {names}{', ...' if len(experts) > 8 else ''}. Save the "
            "model again."
        )


def _config_dtype(config) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def expected_tensors(config) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """{on-disk key: (dtype, shape)} of every tensor a model of `config` saves, from the model built on the meta
    device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_config_dtype(config) or torch.float32)
    return {k: (t.dtype, t.shape) for k, t in checkpoint_state_dict(model).items()}


def _dtype_fits(stored: torch.dtype, expected: torch.dtype) -> bool:
    """A stored dtype the loader may take for `expected`: the same, or a floating dtype of another width (cast on
    load). Same width but another dtype (F32 as I32, BF16 as F16) reinterprets the bytes: never."""
    if stored == expected:
        return True
    return stored.is_floating_point and expected.is_floating_point and stored.itemsize != expected.itemsize


def _check_tensors(weight_map: dict[str, str], headers: dict[str, dict], expected: dict, config) -> None:
    """Every tensor the model takes has the shape of the config and a dtype it can take."""
    for key, filename in weight_map.items():
        if key not in expected:
            continue
        meta = headers[filename][key]
        dtype, shape = SAFETENSORS_DTYPES[meta["dtype"]], torch.Size(meta["shape"])
        want_dtype, want_shape = expected[key]
        if shape != want_shape:
            raise CheckpointError(
                f"{filename} is corrupt or belongs to another model: it stores {key} with shape {list(shape)}, but "
                f"config.json makes it {list(want_shape)}. Restore the file from a good copy, or save the model again."
            )
        if not _dtype_fits(dtype, want_dtype):
            raise CheckpointError(
                f"{filename} is corrupt: it stores {key} as {meta['dtype']}, but the model holds it as "
                f"{str(want_dtype).removeprefix('torch.')} (config.json dtype: "
                f"{_cut(str(getattr(config, 'dtype', None)).removeprefix('torch.'), 40)}); "
                "reading those bytes as the other type would give wrong values. Restore the file, or save again."
            )


def _check_block_paths(directory: Path, config) -> None:
    """`moe_bypassed_paths` turn parts of each MoE layer into identities: only those that the dense MLP is made of
    (as the converter finds it), never a norm or an attention block."""
    if not config.moe_bypassed_paths:
        return
    from transformers import AutoModelForCausalLM

    from .convert.adapters import find_mlp

    try:
        with torch.device("meta"):
            dense = AutoModelForCausalLM.from_config(config.to_base_config())
        spec = find_mlp(dense.get_submodule(config.decoder_layers_path)[config.moe_layers[0]])
        expected = (spec.block_path, list(spec.bypassed_paths))
    except Exception as err:  # noqa: BLE001 - any failure here means the paths cannot be trusted
        expected = ("?", [f"none found ({type(err).__name__})"])
    if (config.moe_block_path, config.moe_bypassed_paths) != expected:
        raise CheckpointError(
            f"{directory}/config.json is invalid: moe_block_path={_brief(config.moe_block_path)} and "
            f"moe_bypassed_paths={_brief(config.moe_bypassed_paths)} would replace parts of each MoE layer with "
            f"identities, but the dense {config.base_model_type} MLP is at {expected[0]!r} with inline parts "
            f"{expected[1]}. Restore config.json (hf_moe writes these fields itself)."
        )


def _check_routers(directory: Path, weight_map: dict[str, str], expected: dict, config) -> None:
    """The routers' tensors (small: E x H per layer) hold only finite numbers: a NaN router routes every token
    arbitrarily, and the model would load and run without a word."""
    from safetensors import safe_open

    prefixes = tuple(f"{config.decoder_layers_path}.{i}.{config.moe_block_path}.gate." for i in config.moe_layers)
    by_file = defaultdict(list)
    for key in expected:
        if key.startswith(prefixes) and key in weight_map:
            by_file[weight_map[key]].append(key)
    for filename, keys in sorted(by_file.items()):
        try:
            with safe_open(directory / filename, framework="pt") as f:
                tensors = {key: f.get_tensor(key) for key in keys}
        except Exception as err:  # noqa: BLE001 - safetensors' own checks: name the file
            raise CheckpointError(f"{filename} is corrupt: {_cut(str(err), 300)}") from None
        for key, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise CheckpointError(
                    f"{filename}: the router weights {key} hold {bad} NaN or infinite value(s) of "
                    f"{tensor.numel()}. Every token would be routed arbitrarily. Training diverged before this "
                    "save, or the file is damaged: load an earlier checkpoint."
                )


@dataclass
class VerifyReport:
    """What `verify_checkpoint` checked and found."""

    directory: Path
    files: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    algorithm: str | None = None
    problems: list[str] = field(default_factory=list)


def verify_checkpoint(directory: str | os.PathLike) -> VerifyReport:
    """Hash every file of a saved checkpoint and compare with the checksums recorded when it was saved; then run
    the checks before load. Every problem is listed (each bad file, and each bad tensor in it), none raised."""
    directory = Path(directory)
    start = time.perf_counter()
    report = VerifyReport(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory.")
    try:
        recover_interrupted_commit(directory)
        weight_map, metadata = read_index(directory)
        checksums = recorded_checksums(metadata)
    except (CheckpointError, FileNotFoundError) as err:
        report.problems.append(_cut(str(err), 600))
        return report
    if checksums is None:
        report.problems.append(
            f"{INDEX_NAME} records no checksums (saved by an older hf_moe, or by another tool): nothing to verify "
            "against. Load it and save it again with this hf_moe to add them."
        )
        return report
    names = sorted(set(weight_map.values()) | set(checksums["files"]))
    report.algorithm = checksums["algorithm"]
    report.files = len(names)
    report.num_bytes = sum((directory / n).stat().st_size for n in names if (directory / n).is_file())
    report.problems += checksum_problems(directory, checksums, names)
    if not report.problems:
        try:
            validate_checkpoint(directory, verify_checksums=False)
        except (CheckpointError, FileNotFoundError) as err:
            report.problems.append(_cut(str(err), 600))
    report.seconds = time.perf_counter() - start
    return report


@contextlib.contextmanager
def local_expert_view(directory: str | os.PathLike, start: int, end: int, verify_checksums: bool | None = False):
    """A temporary directory that looks like `directory` but lists only the non-expert tensors and experts
    [start, end): config and small files are copied, weight files linked, and the index filtered. Loading from it
    reads nothing of the other experts. `verify_checksums` (see `validate_checkpoint`) hashes only the files
    linked, so each rank of an expert-parallel load verifies what it reads."""
    directory = Path(directory).absolute()
    weight_map, metadata = read_index(directory)
    keep = {}
    for key, filename in weight_map.items():
        match = _EXPERT_KEY.match(key)
        if match is None or start <= int(match["expert"]) < end:
            keep[key] = filename
    _verify_data(directory, recorded_checksums(metadata), sorted(set(keep.values())), verify_checksums)
    with tempfile.TemporaryDirectory(prefix="hf_moe-view-") as tmp:
        view = Path(tmp)
        for item in directory.iterdir():
            if item.name == INDEX_NAME or item.is_dir() or not stays_inside(directory, item):
                continue
            if item.name.endswith(".safetensors"):
                if item.name in set(keep.values()):
                    os.symlink(item, view / item.name)
            else:
                shutil.copy2(item, view / item.name)
        (view / INDEX_NAME).write_text(json.dumps({"metadata": metadata, "weight_map": keep}))
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
    instead when either is non-empty. (A plain `transformers.Trainer` resumes the same way, file by file through
    `load_state_dict` and the experts' per-expert-key hook, but reports the keys by their in-memory names.) A
    sharded model (DTensor parameters) is refused: see the error.
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
    validate_checkpoint(directory, verify_checksums=None)
    weight_map, _ = read_index(directory)
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
