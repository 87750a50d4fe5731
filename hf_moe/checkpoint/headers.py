"""safetensors headers, read through the guarded opener and checked entry by entry before any tensor is: UTF-8 JSON
of bounded size and memory, dtypes, shapes and offsets that the safetensors reader and torch accept, and offsets
that tile the data section exactly."""

from __future__ import annotations

import io
import math
import os
import struct
from pathlib import Path

from ..configuration import _brief
from .format import MAX_HEADER_BYTES, SAFETENSORS_DTYPES, CheckpointError
from .guard import open_file, parse_json

_MAX_SIZE = 2**63  # a shape's running product, and a tensor's bytes, stay below it: safetensors and torch overflow past


def read_header(directory: str | os.PathLike, name: str, source: str) -> tuple[dict, bytes]:
    """(header, the bytes it was read from: its 8-byte length and the JSON) of the safetensors file `name` of
    `directory` (named by `source`), after checking the header entry by entry and that the file holds exactly the data
    it declares."""
    with open_file(directory, name, source) as f:
        return header_of(f, name)


def header_of(f: io.FileIO, name: str) -> tuple[dict, bytes]:
    """`read_header` of an open file, read from its start."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) < 8:
        raise CheckpointError(f"{name} is corrupt: it is {size} bytes, too short for a safetensors file.")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > size - 8:
        raise CheckpointError(f"{name} is corrupt: its header is cut off (truncated file?).")
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{name} is corrupt: it declares a {header_len}-byte header (at most {MAX_HEADER_BYTES})."
        )
    raw = f.read(header_len)
    if len(raw) != header_len:
        raise CheckpointError(f"{name} is corrupt: its header is cut off (the file shrank while being read).")
    header = parse_json(raw, name, subject="its header", parse_int=_unsigned_int)
    check_header(name, header, size - 8 - header_len)
    return header, prefix + raw


def _unsigned_int(text: str) -> int:
    """An integer as the safetensors reader takes it: `-0` is a float to it, and refused."""
    if text.startswith("-") and int(text) == 0:
        raise ValueError(f"the integer {text!r} (negative zero)")
    return int(text)


def check_header(name: str, header, data_size: int) -> None:
    """Every entry {"dtype", "shape", "data_offsets"} well-formed, its byte count that of its dtype and shape, and
    the entries tiling the data section exactly."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{name} is corrupt: {what}.")

    if not isinstance(header, dict):
        raise bad(f"its header is a JSON {type(header).__name__}, not an object")
    spans = []
    for key, meta in header.items():
        if not _utf8(key):
            raise bad(f"the tensor name {_brief(key)} is not valid UTF-8")
        if key == "__metadata__":
            if not isinstance(meta, dict) or not all(isinstance(v, str) and _utf8(v) for v in meta.values()):
                raise bad("its __metadata__ is not an object of strings")
            continue
        if not isinstance(meta, dict) or set(meta) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"the header entry of {_brief(key)} is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            raise bad(f"{_brief(key)} has the dtype {_brief(dtype)}, which is not one of {sorted(SAFETENSORS_DTYPES)}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d for d in shape):
            raise bad(f"{_brief(key)} has the shape {_brief(shape)}, not a list of sizes")
        running = 1
        for d in shape:  # (in order, as the safetensors reader multiplies: [2**40, 2**40, 0] overflows it)
            running *= d
            if running >= _MAX_SIZE or d >= _MAX_SIZE:  # (torch takes sizes as int64)
                raise bad(f"{_brief(key)} has the shape {_brief(shape)}, whose size overflows 64-bit arithmetic")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] < _MAX_SIZE):
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


def _utf8(text: str) -> bool:
    """Whether `text` is encodable as UTF-8 (JSON's `\\ud800` escapes decode to lone surrogates, which it is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a safetensors file, after checking every entry and that the file holds exactly the data
    it declares. The file is opened through the guarded opener, as a file of its own directory."""
    path = Path(path)
    return read_header(path.parent, path.name, "the caller")[0]
