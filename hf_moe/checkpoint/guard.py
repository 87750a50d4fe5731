"""The one way hf_moe opens a file of a checkpoint: a plain name inside the directory, never a link out of it, a
regular file (a FIFO or a device is refused without blocking), bounded in size, and parsed with bounded memory.
A checkpoint reads nothing outside itself.

Every read of a checkpoint's files goes through here: safetensors headers and checksums (`open_file`), the index,
config, generation config and training-state files (`read_json`), tokenizer files (`copy_files`), and the
safetensors reads of the safetensors library itself (`safe_open_file`, `load_safetensors`: after the same checks).
transformers reads config.json, generation_config.json and the weights again when it loads a model, after
`validate_checkpoint` has checked each of them here. `tests/test_hostile_opener.py` greps the package for reads that
bypass this module.

Costs: one `stat` and one `fstat` per file opened; JSON is counted (three `bytes.count`) and its nesting measured
(a few passes over its brackets) before it is parsed.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import io
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file

from ..configuration import _brief, _cut
from .format import MAX_CONFIG_BYTES, MAX_FILE_BYTES, MAX_JSON_DEPTH, MAX_JSON_VALUES, CheckpointError

try:
    import fcntl
except ImportError:  # not POSIX: no O_NONBLOCK to clear
    fcntl = None

_PLAIN_NAME = re.compile(r"[^/\\\x00]{1,255}")
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
)


def checkpoint_file(directory: str | os.PathLike, name, source: str) -> Path:
    """`directory / name` for a file name read from `source` (the index, say), after checking that it names a
    file of the directory: a plain name, not a path, and not a symbolic link out of the directory (except, in a
    Hugging Face Hub cache snapshot, into that repository's `blobs/`). A checkpoint reads nothing outside itself.
    Only the name is checked: open the file with `open_file`."""
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
    in a Hugging Face Hub cache snapshot or a subfolder of one, into that repository's `blobs/`)."""
    if not path.is_symlink():
        return True
    real, root = Path(os.path.realpath(path)), Path(os.path.realpath(directory))
    allowed = [root]
    snapshot = next((a for a in (root, *root.parents) if a.parent.name == "snapshots"), None)  # (a subfolder's too)
    if snapshot is not None:
        allowed.append(snapshot.parent.parent / "blobs")
    return any(real == base or base in real.parents for base in allowed)


def _not_regular(path: Path, mode: int) -> CheckpointError:
    kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
    return CheckpointError(
        f"{path} is {kind}, not a regular file: a checkpoint holds only regular files, and reading this one could "
        "block or never end. Replace it with the file it should be (or save the model again)."
    )


def check_regular(directory: str | os.PathLike, name, source: str, max_bytes: int | None = None) -> Path:
    """`checkpoint_file`, and the file is a regular file (not a FIFO or a device, which is refused without being
    opened) of at most `max_bytes`. For a file that another library opens after this check."""
    path = checkpoint_file(directory, name, source)
    mode_size = os.stat(path)  # FileNotFoundError names the path
    if not stat.S_ISREG(mode_size.st_mode):
        raise _not_regular(path, mode_size.st_mode)
    if max_bytes is not None and mode_size.st_size > max_bytes:
        raise _too_big(path, mode_size.st_size, max_bytes)
    return path


def _too_big(path: Path, size: int, max_bytes: int) -> CheckpointError:
    return CheckpointError(
        f"{path} is {size} bytes, more than any {path.name} a model needs (at most {max_bytes}): refusing to read it."
    )


def open_fd(directory: str | os.PathLike, name, source: str, *, max_bytes: int | None = None) -> int:
    """A descriptor of the file `name` of `directory` (named by `source`), open for reading; the caller closes it.

    Refused with a `CheckpointError` naming it: a name that is not a plain file name, a symbolic link out of the
    directory, anything but a regular file (checked before opening, and again on the descriptor, opened with
    O_NONBLOCK so that a FIFO swapped in between cannot block the open), and a file of more than `max_bytes`.
    A missing file raises `FileNotFoundError`.
    """
    path = check_regular(directory, name, source, max_bytes)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as err:  # ENXIO: a socket swapped in; ELOOP: a link loop. (EMFILE, EACCES ... are raised as such)
        if err.errno not in (errno.ENXIO, errno.ELOOP):
            raise
        raise CheckpointError(
            f"{path} cannot be opened ({err.strerror}). Restore it, or save the model again."
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(path, info.st_mode)
        if max_bytes is not None and info.st_size > max_bytes:
            raise _too_big(path, info.st_size, max_bytes)
        if fcntl is not None:  # reads of a regular file never block; clear the flag for the libraries that read it
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def open_file(
    directory: str | os.PathLike, name, source: str, *, max_bytes: int | None = None
) -> Iterator[io.FileIO]:
    """The file `name` of `directory`, opened for reading, unbuffered, after the checks of `open_fd`."""
    fd = open_fd(directory, name, source, max_bytes=max_bytes)
    try:
        file = io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise
    with file:
        yield file


def read_bytes(directory: str | os.PathLike, name, source: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The whole file (see `open_file`), refused if it holds more than `max_bytes` (also if it grew while read)."""
    with open_file(directory, name, source, max_bytes=max_bytes) as f:
        data = _read_at_most(f, max_bytes + 1)
    if len(data) > max_bytes:
        raise _too_big(Path(directory) / name, len(data), max_bytes)
    return data


def _read_at_most(f: io.FileIO, limit: int) -> bytes:
    chunks, total = [], 0
    while total < limit:
        chunk = f.read(min(limit - total, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def read_json(directory: str | os.PathLike, name, source: str, max_bytes: int = MAX_CONFIG_BYTES) -> dict:
    """A JSON object from the file `name` of `directory` (see `open_file` and `parse_json`), or a `CheckpointError`
    that names the file."""
    path = Path(directory) / name
    value = parse_json(read_bytes(directory, name, source, max_bytes), str(path))
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is corrupt: it holds a JSON {type(value).__name__}, not an object.")
    return value


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def parse_json(
    raw: bytes, where: str, *, subject: str = "it", max_values: int = MAX_JSON_VALUES, max_depth: int = MAX_JSON_DEPTH,
    parse_int=None,
):
    """`raw` parsed as JSON, with bounded memory: UTF-8 only (no byte-order mark, no UTF-16), at most `max_values`
    values (counted before parsing), nested at most `max_depth` deep, and no key twice in an object (`parse_int`:
    as `json.loads`'s). Raises a `CheckpointError`: "`where` is corrupt: `subject` is not valid JSON (...)"."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where} is corrupt: {subject} {what}. Restore it from a good copy, or save the model "
                               "again.")

    if raw.startswith(codecs.BOM_UTF8):
        raise bad("starts with a byte-order mark, which JSON written by hf_moe and safetensors never has")
    values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if values > max_values:
        raise bad(f"holds up to {values} JSON values, more than {max_values}: refusing to parse it (its memory "
                  "would be unbounded)")
    if not _nested_at_most(raw, max_depth):
        raise bad(f"nests more than {max_depth} levels deep")
    try:
        text = raw.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_int=parse_int)
    except UnicodeDecodeError as err:
        raise bad(f"is not UTF-8 ({_cut(str(err), 200)})") from None
    except (ValueError, RecursionError) as err:
        raise bad(f"is not valid JSON ({_cut(str(err), 300)})") from None


def _nested_at_most(raw: bytes, depth: int) -> bool:
    """Whether the brackets of `raw` (outside strings) nest at most `depth` deep: each pass removes at least the
    innermost level. Unbalanced brackets pass here; the parser names them."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(depth):
        if not brackets:
            return True
        shorter = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if shorter == brackets:
            return True
        brackets = shorter
    return not brackets


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {_brief(twice)} appears twice in one object")
    return value


def copy_files(
    directory: str | os.PathLike, names, destination: str | os.PathLike, source: str
) -> tuple[list[str], list[str]]:
    """Copy the files `names` of `directory` that exist into `destination`, byte for byte, each read through
    `open_file`. Returns (names copied, one line for each file refused: a link out, a FIFO, ...)."""
    copied, refused = [], []
    for name in names:
        if not os.path.lexists(Path(directory) / name):
            continue
        try:
            data = read_bytes(directory, name, source)
        except (CheckpointError, OSError) as err:
            refused.append(_cut(str(err), 300))
            continue
        (Path(destination) / name).write_bytes(data)
        copied.append(name)
    return copied, refused


def safe_open_file(directory: str | os.PathLike, name, source: str):
    """`safetensors.safe_open` of a checkpoint file, after the checks of `open_file` (the library opens it again
    by path)."""
    return safe_open(check_regular(directory, name, source), framework="pt")


def load_safetensors(directory: str | os.PathLike, name, source: str) -> dict:
    """`safetensors.torch.load_file` of a checkpoint file, after the checks of `open_file`."""
    return load_file(check_regular(directory, name, source))
