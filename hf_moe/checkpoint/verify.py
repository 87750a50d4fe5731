"""`verify_checkpoint` (`hf-moe verify DIR`): every file hashed against the checksums recorded at save time, then the
checks before load; every problem listed, none raised."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..configuration import _cut
from .checks import read_index
from .checksums import checksum_problems, recorded_checksums
from .commit import recover_interrupted_commit
from .format import INDEX_NAME, CheckpointError
from .load import validate_checkpoint


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
