"""Files a user names that are not checkpoints (calibration text, a merge recipe), read in bounded memory whatever
their size, and only as far as the caller needs.

Text is read in pieces of at most `PIECE_CHARS` characters, each cut at a line end where it has one, so that a
caller tokenizes piece by piece and stops once it has the tokens it needs (`token_ids`): a 100 GB file costs what
its first pieces cost. A fast tokenizer holds a few hundred bytes per character of the string it is given while it
works, which is why a piece is small. What is parsed whole (a .json file of records, one .jsonl line, a YAML recipe)
is refused above its limit, before it is read. A NUL character is refused where it is met: text holds none, and a
binary file (or the unwritten hole of a sparse one) would otherwise be tokenized as text.

    .txt (or any file, with records=False)   one text
    .jsonl                                   one record a line, its `text` field a text
    .json                                    a list of records (or one), each with a `text` field
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

PIECE_CHARS = 1 << 16  # characters tokenized at once
MAX_LINE_CHARS = 32 << 20  # one .jsonl record
MAX_JSON_BYTES = 32 << 20  # a .json file of records, parsed whole
TEXT_KINDS = (".txt", ".json", ".jsonl")


class InputFileError(ValueError):
    """A file the user named cannot be read as asked; the message names it and says what to do."""


def size_text(num_bytes: int) -> str:
    """32 MiB, 8 MiB, 512 KiB, 100 bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):g} {unit}"
    return f"{num_bytes} bytes"


def read_limited(path: str | os.PathLike, what: str, limit: int, advice: str) -> bytes:
    """The bytes of the regular file at `path`, refused (an `InputFileError` naming `limit`, then `advice`) when it
    holds more than `limit` bytes: its size is checked before it is read, and the read stops one byte past the limit
    (a file that grew meanwhile)."""
    path = _regular(path, what)
    size = os.stat(path).st_size
    if size <= limit:
        with open(path, "rb") as f:  # (the user's file, not a checkpoint's)
            data = f.read(limit + 1)
        if len(data) <= limit:
            return data
        size = len(data)
    raise InputFileError(f"{what} {path} holds {size} bytes, over the {size_text(limit)} limit for such a file: "
                         f"{advice}")


def texts(path: str | os.PathLike, what: str, records: bool = True) -> Iterator[tuple[str, bool]]:
    """The text of the file at `path` as (piece, whether the piece starts a text), in order, read as it is consumed.

    With `records`, a .jsonl or .json file holds records with a `text` field (see the module docstring); else every
    file is one text. Raises `InputFileError` for a NUL character, an oversized record or file, a line that is not
    JSON, or records none of which has a `text` string (only as far as the consumer reads)."""
    path = _regular(path, what)
    kind = path.suffix.lower() if records else ".txt"
    if kind == ".json":
        yield from _json_texts(path, what)
        return
    with open(path, encoding="utf-8", errors="replace") as f:  # (the user's file, not a checkpoint's)
        if kind == ".jsonl":
            yield from _jsonl_texts(f, path, what)
        else:
            yield from _pieces(f.read, f"{what} {path}")


def token_ids(path: str | os.PathLike, tokenizer, max_tokens: int, what: str, records: bool = True) -> list[int]:
    """The first `max_tokens` token ids of the file's text (`texts`), tokenized piece by piece until there are
    enough: the rest of the file is never read. Each text gets the tokenizer's special tokens once, at its start
    (a text that fits in one piece is tokenized exactly as a whole)."""
    ids: list[int] = []
    if max_tokens <= 0:
        return ids
    for piece, starts in texts(path, what, records):
        ids.extend(tokenizer(piece, add_special_tokens=starts)["input_ids"])
        if len(ids) >= max_tokens:
            break
    return ids[:max_tokens]


# ------------------------------------------------------------------------------------------------------ pieces
def _regular(path: str | os.PathLike, what: str) -> Path:
    """`path`, which must be a regular file (a FIFO or a device would never end)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} is not a file" + (" (it is a directory)." if path.is_dir()
                                                                         else "."))
    return path


def _pieces(read: Callable[[int], str], where: str) -> Iterator[tuple[str, bool]]:
    """(piece, starts) of the text that `read(n)` returns n characters of at a time ("" at its end): pieces of at most
    PIECE_CHARS characters, each cut after its last line end when more text follows."""
    carry, starts, seen = "", True, 0
    while True:
        chunk = read(PIECE_CHARS - len(carry))
        nul = chunk.find("\x00")
        if nul >= 0:
            raise InputFileError(f"{where} holds a NUL character (character {seen + nul}): it is binary data, not "
                                 "text. Give a UTF-8 text file.")
        seen += len(chunk)
        text, carry = carry + chunk, ""
        if not text:
            return
        if chunk and len(text) >= PIECE_CHARS:  # more may follow: a word is not cut where a line end allows
            cut = text.rfind("\n") + 1
            if cut:
                text, carry = text[:cut], text[cut:]
        yield text, starts
        starts = False
        if not chunk:
            return


def _jsonl_texts(f, path: Path, what: str, number: int = 0) -> Iterator[tuple[str, bool]]:
    found = False
    for line in iter(lambda: f.readline(MAX_LINE_CHARS + 1), ""):
        number += 1
        if len(line) > MAX_LINE_CHARS:
            raise InputFileError(f"{what} {path}: line {number} is longer than the {size_text(MAX_LINE_CHARS)} "
                                 "characters a record may have: one record a line, each a few thousand tokens.")
        if "\x00" in line:
            raise InputFileError(f"{what} {path}: line {number} holds a NUL character: it is binary data, not "
                                 "JSON Lines.")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputFileError(f"{what} {path}: line {number} is not valid JSON: {err}.") from None
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            found = True
            yield from _pieces(io.StringIO(record["text"]).read, f"{what} {path}, line {number}")
    if not found:
        raise InputFileError(f"{what} {path} holds no record with a `text` field (a string).")


def _json_texts(path: Path, what: str) -> Iterator[tuple[str, bool]]:
    raw = read_limited(path, what, MAX_JSON_BYTES, "a .json file is parsed whole; give the text as .jsonl (one "
                       "record a line) or .txt, which are read only as far as needed.")
    raw = raw.decode("utf-8", errors="replace")
    try:
        records = json.loads(raw)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # JSON Lines in a .json file (as `datasets` reads them)
            yield from _jsonl_texts(io.StringIO(raw), path, what)
            return
        raise InputFileError(f"{what} {path} is not valid JSON: {err}.") from None
    records = records if isinstance(records, list) else [records]
    found = [r["text"] for r in records if isinstance(r, dict) and isinstance(r.get("text"), str)]
    if not found:
        raise InputFileError(f"{what} {path} holds no record with a `text` field (a string).")
    del raw, records
    for i, text in enumerate(found):
        yield from _pieces(io.StringIO(text).read, f"{what} {path}, record {i}")
