"""`verify_checkpoint` (`hf-moe verify DIR`): every file hashed against the checksums recorded at save time (the weights
and the config files), then the checks before load; every problem listed, none raised. `record_config_files`
(`hf-moe verify --update DIR`) records config files that were changed on purpose."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..configuration import _cut
from ..layers.quantized import CONFIG_FIELD as QUANTIZATION_FIELD
from .checks import read_config, read_index
from .checksums import checksum_problems, config_checksums, config_problems, recorded_checksums
from .commit import recover_interrupted_commit, replace_file
from .format import INDEX_NAME, MAX_INDEX_BYTES, CheckpointError
from .guard import read_json
from .load import validate_checkpoint, validate_files
from .snapshot import exclusive, reading


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
    the checks before load. Every problem is listed (each bad file, and each bad tensor in it), none raised. A save
    into the directory meanwhile waits (or, past its wait, makes this raise `CheckpointBusyError`). A directory that
    holds no hf_moe checkpoint at all (a dense model saved by transformers) raises a `CheckpointError` saying so:
    `hf-moe verify` exits 2 for it, not 1 as for damage."""
    directory = Path(directory)
    start = time.perf_counter()
    report = VerifyReport(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory.")
    with reading(directory):
        foreign = _not_hf_moe(directory)
        if foreign is not None:
            raise CheckpointError(foreign)
        _verify(directory, report)
    report.seconds = time.perf_counter() - start
    return report


def _not_hf_moe(directory: Path) -> str | None:
    """Why `directory` is no hf_moe checkpoint at all (a model saved by transformers, or no model), or None: an hf_moe
    checkpoint, maybe damaged (its config.json or index says hf_moe, or cannot be read), which `_verify` checks."""
    config = index = None
    try:
        if os.path.lexists(directory / "config.json"):
            config = read_json(directory, "config.json", "the checkpoint")
        if os.path.lexists(directory / INDEX_NAME):
            index = read_json(directory, INDEX_NAME, "the checkpoint", MAX_INDEX_BYTES)
    except (CheckpointError, OSError):
        return None  # damaged: named by the checks
    metadata = index.get("metadata") if index is not None else None
    if config is None and index is None:
        if os.path.lexists(directory / "model.safetensors"):
            return None
        return (f"{directory} holds no saved model (no config.json, no {INDEX_NAME}): `hf-moe verify` checks a "
                "directory hf_moe saved.")
    if (config or {}).get("model_type") == "hf_moe" or (isinstance(metadata, dict)
                                                         and metadata.get("format") == "hf_moe"):
        return None
    if config is not None and isinstance(config.get("model_type"), str):
        return (f"{directory} holds a `{_cut(config['model_type'], 60)}` model, not an hf_moe checkpoint: nothing is "
                "damaged, but `hf-moe verify` checks what hf_moe saved (its checksums are recorded at save time). "
                f"Convert it first (`hf-moe convert {directory} OUT`), or load it with transformers.")
    return None


def _verify(directory: Path, report: VerifyReport) -> None:
    try:
        recover_interrupted_commit(directory)
        weight_map, metadata = read_index(directory)
        checksums = recorded_checksums(metadata)
    except (CheckpointError, FileNotFoundError) as err:
        report.problems.append(_cut(str(err), 600))
        return
    if checksums is None:
        report.problems.append(
            f"{INDEX_NAME} records no checksums (saved by an older hf_moe, or by another tool): nothing to verify "
            "against. Load it and save it again with this hf_moe to add them."
        )
        return
    names = sorted(set(weight_map.values()) | set(checksums["files"]))
    report.algorithm = checksums["algorithm"]
    report.files = len(names) + len(checksums.get("config_files", {}))
    report.num_bytes = sum(os.stat(directory / n).st_size for n in names if os.path.isfile(directory / n))
    changed = config_problems(directory, checksums)
    if changed:
        report.problems += changed
        report.problems.append(
            f"(the config files decide what the weights compute; if you changed them on purpose, record it with "
            f"`hf-moe verify --update {directory}`)"
        )
    report.problems += checksum_problems(directory, checksums, names, finite=True)
    if not report.problems:
        try:
            if QUANTIZATION_FIELD in read_config(directory):  # int8 experts (hf_moe.quantize): not the config's model
                validate_files(directory)  # (their dtypes and shapes are checked when they load)
            else:
                validate_checkpoint(directory, verify_checksums=False)
        except (CheckpointError, FileNotFoundError) as err:
            report.problems.append(_cut(str(err), 600))


def record_config_files(directory: str | os.PathLike) -> list[str]:
    """Record in the index the checksums of the config files as they are now (config.json, generation_config.json,
    the `auto_map` shim): for a config changed on purpose. The index is replaced atomically, keeping its mode, while
    no load of the directory runs (what a killed update leaves, the next one removes: `commit.replace_file`).
    Returns the names whose record changed. Verify afterwards: the new values are checked as on every load."""
    directory = Path(directory)
    with exclusive(directory):
        index_path = directory / INDEX_NAME
        _, metadata = read_index(directory)
        checksums = recorded_checksums(metadata)
        if checksums is None:
            raise CheckpointError(
                f"{index_path} records no checksums (saved by an older hf_moe): load the model and save it again."
            )
        index = read_json(directory, INDEX_NAME, "the checkpoint", MAX_INDEX_BYTES)
        before = checksums.get("config_files", {})
        after = config_checksums(directory, checksums["algorithm"])
        index["metadata"]["checksums"]["config_files"] = after
        replace_file(index_path, (json.dumps(index, indent=2) + "\n").encode())  # (its mode kept; see commit.py)
    return sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
