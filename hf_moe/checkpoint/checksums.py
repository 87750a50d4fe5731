"""Checksums of every saved file, recorded in the index and checked at load.

`index["metadata"]["checksums"]`: {"algorithm": "xxh3_128", "files": {file: {"size": bytes, "header": hash of the
8-byte length and the JSON header, "tensors": {key: hash of its bytes}}}, "config_files": {name: {"size": bytes,
"hash": hash of the file}}}. `config_files` covers config.json, generation_config.json and the `auto_map` shim
(`format.CONFIG_FILES`): they decide what the weights compute. Every load checks the sizes and the header hashes (a
few KB per file) and the config files; `verify_checksums=True` (or `hf-moe verify DIR`) hashes the data too and
names each file and tensor whose bytes changed. The cost is measured in benchmarks/checksums.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..configuration import _brief, _cut
from .format import (
    CHECKSUM_ALGORITHM, CHECKSUM_ALGORITHMS, CONFIG_FILES, INDEX_NAME, MAX_CONFIG_BYTES, SAFETENSORS_DTYPES,
    VERIFY_CHECKSUMS_BY_DEFAULT, CheckpointError,
)
from .guard import checkpoint_file, open_file, read_bytes
from .headers import header_of

_HASH_CHUNK = 1 << 20  # read and hashed while still in the CPU cache, faster than larger reads (docs/checkpoints.md)
_MAX_PROBLEMS_SHOWN = 12


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
    config_files = checksums.get("config_files", {})
    if not isinstance(config_files, dict) or not all(
        name in CONFIG_FILES and isinstance(record, dict) and isinstance(record.get("size"), int)
        and isinstance(record.get("hash"), str) and hex_digest.fullmatch(record["hash"])
        for name, record in config_files.items()
    ):
        raise bad(f"of the config files are not {{name: {{size, hash}}}} for names among {list(CONFIG_FILES)}")
    return checksums


def file_checksums(path: str | os.PathLike, algorithm: str = CHECKSUM_ALGORITHM, progress=None,
                   nonfinite: dict | None = None) -> tuple[dict, dict]:
    """(header, {"size", "header", "tensors": {key: digest}}) of a safetensors file (opened through the guarded
    opener, as a file of its directory): the hash of its header bytes, and of each tensor's bytes. `progress(n)` is
    called with the bytes hashed. With `nonfinite` (a dict), the floating tensors' NaN and infinite values are counted
    in the same pass over the bytes: {key: (count, numel)} of each tensor that holds any."""
    path = Path(path)
    new = CHECKSUM_ALGORITHMS[algorithm]
    with open_file(path.parent, path.name, INDEX_NAME) as f:
        header, raw = header_of(f, path.name)
        spans = sorted(
            (m["data_offsets"][0], m["data_offsets"][1], k) for k, m in header.items() if k != "__metadata__"
        )
        record = {"size": len(raw) + (spans[-1][1] if spans else 0), "header": new(raw).hexdigest(), "tensors": {}}
        buffer = memoryview(bytearray(min(_HASH_CHUNK, max((e - b for b, e, _ in spans), default=1) or 1)))
        for begin, end, key in spans:  # contiguous: `_check_header` saw to it
            digest, remaining = new(), end - begin
            dtype = SAFETENSORS_DTYPES.get(header[key]["dtype"]) if nonfinite is not None else None
            count = _NonFinite(dtype) if dtype is not None and dtype.is_floating_point else None
            while remaining:
                got = f.readinto(buffer[: min(remaining, len(buffer))])
                if not got:
                    raise CheckpointError(f"{path.name} ended while reading {key}: the file is truncated.")
                digest.update(buffer[:got])
                if count is not None:
                    count.update(buffer[:got])
                remaining -= got
            record["tensors"][key] = digest.hexdigest()
            if count is not None and count.bad:
                nonfinite[key] = (count.bad, (end - begin) // dtype.itemsize)
            if progress is not None:
                progress(end - begin)
    return header, record


class _NonFinite:
    """Counts the NaN and infinite values of a floating tensor fed to it in chunks of its bytes (a chunk may end
    inside a value: its bytes wait for the next chunk). With numpy, on one thread: about what hashing the chunk costs
    (docs/checkpoints.md; torch's reductions start a thread pool per call, which costs far more on a busy machine).
    float32/64 and float16: max and min (NaN propagates, an infinity is one of them), counted only when not finite;
    bfloat16: its exponent bits (all ones: NaN or infinity); 8-bit floats: through torch, as float32."""

    _NUMPY = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.bad, self.rest = dtype, 0, bytearray()

    def update(self, chunk: memoryview) -> None:
        data = self.rest + chunk if self.rest else chunk
        whole = len(data) - len(data) % self.dtype.itemsize
        self.rest = bytearray(data[whole:])
        if whole:
            self.bad += self._count(data[:whole])

    def _count(self, data) -> int:
        if self.dtype in self._NUMPY:
            values = np.frombuffer(data, dtype=self._NUMPY[self.dtype])
            if np.isfinite(values.max()) and np.isfinite(values.min()):
                return 0
            return int(np.count_nonzero(~np.isfinite(values)))
        if self.dtype == torch.bfloat16:
            return int(np.count_nonzero((np.frombuffer(data, dtype=np.uint16) & 0x7F80) == 0x7F80))
        values = torch.frombuffer(bytearray(data), dtype=self.dtype).float()  # (float8: no isfinite of its own)
        return int((~torch.isfinite(values)).sum())


def checksum_files(directory: Path, names: list[str], desc: str, algorithm: str = CHECKSUM_ALGORITHM):
    """Yield (name, header, checksums) of each file, with a progress bar over the bytes."""
    total = sum((directory / n).stat().st_size for n in names if (directory / n).is_file())
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False) as bar:
        for name in names:
            header, record = file_checksums(directory / name, algorithm, progress=bar.update)
            yield name, header, record


def checksum_problems(directory: str | os.PathLike, checksums: dict, names=None, finite: bool = False) -> list[str]:
    """One line for each file (of `names`, default all recorded) whose bytes differ from those recorded at save
    time, and for each tensor in it whose bytes differ; with `finite`, also for each floating tensor that holds NaN
    or infinite values (`hf-moe verify`: a checkpoint saved so, by a diverged run or a bad merge, matches its
    checksums but computes NaN)."""
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
        elif not os.path.lexists(path):
            problems.append(f"{name}: missing")
        else:
            present.append(name)
    total = sum(os.stat(directory / n).st_size for n in present)
    with tqdm(total=total, unit="B", unit_scale=True, desc="Verifying checksums", leave=False) as bar:
        for name in present:
            record, nonfinite = records[name], {} if finite else None
            try:
                header, actual = file_checksums(directory / name, checksums["algorithm"], progress=bar.update,
                                                nonfinite=nonfinite)
            except CheckpointError as err:
                problems.append(f"{name}: {_cut(str(err), 300)}")
                continue
            for key, (bad, numel) in sorted((nonfinite or {}).items()):
                problems.append(f"{name}: tensor {_brief(key)} holds {bad} NaN or infinite value(s) of {numel}")
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


def config_checksums(directory: str | os.PathLike, algorithm: str = CHECKSUM_ALGORITHM) -> dict[str, dict]:
    """{name: {"size", "hash"}} of the config files (`format.CONFIG_FILES`) that `directory` holds."""
    directory, new = Path(directory), CHECKSUM_ALGORITHMS[algorithm]
    records = {}
    for name in CONFIG_FILES:
        if os.path.lexists(directory / name):
            data = read_bytes(directory, name, "the checkpoint", MAX_CONFIG_BYTES)
            records[name] = {"size": len(data), "hash": new(data).hexdigest()}
    return records


def config_problems(directory: str | os.PathLike, checksums: dict | None) -> list[str]:
    """One line for each config file (`format.CONFIG_FILES`) that differs from the one saved, was added or is
    gone; none when the checkpoint records no checksums of its config files (saved by an older hf_moe)."""
    if checksums is None or "config_files" not in checksums:
        return []
    recorded = checksums["config_files"]
    try:
        actual = config_checksums(directory, checksums["algorithm"])
    except (CheckpointError, OSError) as err:
        return [_cut(str(err), 400)]
    problems = []
    for name in CONFIG_FILES:
        if name in recorded and name not in actual:
            problems.append(f"{name}: missing (it was saved with the model)")
        elif name in actual and name not in recorded:
            problems.append(f"{name}: added after the save (no checksum was recorded for it)")
        elif name in actual and actual[name] != recorded[name]:
            problems.append(f"{name}: changed since the save (its checksum differs from the recorded one)")
    return problems


def config_changed_error(directory, problems: list[str]) -> CheckpointError:
    listed = "\n".join(f"  - {p}" for p in problems)
    return CheckpointError(
        f"{directory} is not the checkpoint that was saved: its config files changed:\n{listed}\nThese files decide "
        "what the weights compute, so a change is a changed checkpoint. Restore them from a good copy. If you changed "
        f"them on purpose, record the change with `hf-moe verify --update {directory}` (or pass the new values to "
        "from_pretrained as keyword arguments, e.g. num_experts_per_tok=1, and save the model again)."
    )


def problems_error(directory, problems: list[str], what: str) -> CheckpointError:
    shown = "\n".join(f"  - {p}" for p in problems[:_MAX_PROBLEMS_SHOWN])
    more = f"\n  ... and {len(problems) - _MAX_PROBLEMS_SHOWN} more" if len(problems) > _MAX_PROBLEMS_SHOWN else ""
    return CheckpointError(
        f"{directory} is corrupt: {len(problems)} problem(s) {what}:\n{shown}{more}\n"
        "Restore these files from a good copy, or save the model again. (`hf-moe verify DIR` lists them all.)"
    )


def verify_data(directory: Path, checksums: dict | None, names: list[str], verify_checksums: bool | None) -> None:
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
        raise problems_error(directory, problems, "against the checksums recorded at save time")
