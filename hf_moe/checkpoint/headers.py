"""safetensors headers, read and checked entry by entry before any tensor is: dtypes, shapes, offsets that tile the
data section exactly."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from ..configuration import _brief, _cut
from .format import MAX_HEADER_BYTES, SAFETENSORS_DTYPES, CheckpointError


def read_header(path: Path) -> tuple[dict, bytes]:
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
    check_header(path.name, header, size - 8 - header_len)
    return header, prefix + raw


def check_header(name: str, header, data_size: int) -> None:
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
    return read_header(Path(path))[0]
