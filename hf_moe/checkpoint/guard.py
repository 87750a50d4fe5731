"""The one way hf_moe opens a file of a checkpoint: a plain name inside the directory, never a link out of it,
bounded in size, parsed with bounded memory. A checkpoint reads nothing outside itself."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..configuration import _brief, _cut
from .format import MAX_JSON_BYTES, CheckpointError


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


def read_json(path: Path) -> dict:
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
