"""What the hostile-file tests (tests/test_hostile_*.py) share: a checkpoint is a directory, nothing outside it is
read, and no corruption loads silently. Each hostile input must be refused with a message that names the bad file,
except flipped data bytes loaded without verification; with verification every one is refused. Reads outside the
checkpoint are counted by inotify on the directory that holds the bait files (any reader, Rust included).

Each tests/test_hostile_*.py module prints one line (tests/conftest.py), counted while it ran:

    test_hostile_X.py: M hostile files over K classes, 0 accepted (under verify), 0 read outside; H loads by Hub id
    exact, E size estimates within 1%

A test counts what it presents with `hostile()`; its class is the calling test.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from pathlib import Path

import pytest
import torch
from conftest import copy_checkpoint, random_ids

import hf_moe.checkpoint as checkpoint
from hf_moe import CheckpointError, MoEForCausalLM

COUNTS = {"hostile": 0, "outside": 0, "verify": 0, "hub": 0, "estimates": 0}
CLASSES: set[str] = set()  # the tests that presented hostile files: one class of input each


def counter(module: str):
    """The count line of `module`, as a function called when it has run: what was counted from now until then."""
    counts, classes = dict(COUNTS), set(CLASSES)

    def line() -> str:
        new = {key: COUNTS[key] - counts[key] for key in COUNTS}
        return (f"{module}: {new['hostile']} hostile files over {len(CLASSES - classes)} classes, {new['verify']} "
                f"accepted (under verify), {new['outside']} read outside; {new['hub']} loads by Hub id exact, "
                f"{new['estimates']} size estimates within 1%")

    return line


class OutsideReads:
    """Counts every open and read of a file in `directory`, by any code in any language, through Linux inotify."""

    IN_ACCESS, IN_OPEN, IN_ISDIR = 0x1, 0x20, 0x40000000

    def __init__(self, directory: Path):
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(directory), self.IN_ACCESS | self.IN_OPEN) < 0:
            pytest.skip("inotify is not available here")

    def count(self) -> int:
        events = 0
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return events
            at = 0
            while at < len(data):
                _, mask, _, length = struct.unpack_from("iIII", data, at)
                events += not mask & self.IN_ISDIR
                at += 16 + length

    def close(self) -> None:
        os.close(self.fd)


class Bait:
    """A directory beside the checkpoints for files a hostile checkpoint reaches for. `arm()` once they are in
    place: reads from then on go into the module's count (and fail the test)."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir()
        self.watch = OutsideReads(directory)

    def arm(self) -> None:
        self.watch.count()  # the test's own setup

    def reads(self) -> int:
        return self.watch.count()


@pytest.fixture(scope="session")
def saved(tiny_moe):
    """conftest's tiny MoE checkpoint (4 experts in every layer, top-2: exportable as Mixtral; read-only), and its
    reference logits."""
    return tiny_moe.path, tiny_moe.logits


@pytest.fixture
def outside(tmp_path):
    bait = Bait(tmp_path / "outside")
    yield bait
    reads = bait.reads()
    COUNTS["outside"] += reads
    bait.watch.close()
    assert reads == 0, f"{reads} open(s) or read(s) of files outside the checkpoint"


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(random_ids()).logits


def copy_of(source: Path, destination: Path) -> Path:
    return copy_checkpoint(source, destination)


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def without_checksums(directory: Path) -> None:
    """As a checkpoint saved before checksums existed (or by another tool)."""
    edit_json(directory / checkpoint.INDEX_NAME, lambda index: index.setdefault("metadata", {}).pop("checksums", None))


def edit_header(path: Path, change) -> None:
    """Rewrite a safetensors header (same data), keeping its byte length so the data stays in place."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    assert len(blob) <= n
    path.write_bytes(raw[:8] + blob + b" " * (n - len(blob)) + raw[8 + n :])


def hostile(n: int = 1) -> None:
    """Count hostile files (or directories) presented to hf_moe, and their class (the calling test)."""
    COUNTS["hostile"] += n
    CLASSES.add(sys._getframe(1).f_code.co_name)


def refused(load, *names: str, error=CheckpointError) -> str:
    """Run `load`, which must raise `error` naming each of `names`. Returns the message."""
    with pytest.raises(error) as info:
        load()
    message = str(info.value)
    for name in names:
        assert name in message, (name, message)
    assert len(message) < 3000
    return message


def refused_under_verify(directory: Path, *names: str) -> None:
    try:
        MoEForCausalLM.from_pretrained(directory, verify_checksums=True)
    except (CheckpointError, OSError) as err:
        for name in names:
            assert name in str(err), (name, str(err))
    else:
        COUNTS["verify"] += 1
        raise AssertionError(f"{directory} loaded under verify_checksums=True")


def expert_file(directory: Path, e: int = 1) -> Path:
    return directory / f"model-expert-{e:05d}.safetensors"




def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.hf_moe"))



def record_checksums(directory: Path, path: Path, tensors: bool = True) -> None:
    """Record `path`'s checksums in the index as they now are (a consistent edit, as another tool would make it),
    its tensors read with Python's lenient JSON parser."""
    import xxhash

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n]) if tensors else {}
    tensors = {k: xxhash.xxh3_128(raw[8 + n + m["data_offsets"][0] : 8 + n + m["data_offsets"][1]]).hexdigest()
               for k, m in header.items() if k != "__metadata__" and isinstance(m, dict) and "data_offsets" in m}
    record = {"size": len(raw), "header": xxhash.xxh3_128(raw[: 8 + n]).hexdigest(), "tensors": tensors}
    edit_json(directory / checkpoint.INDEX_NAME,
              lambda index: index["metadata"]["checksums"]["files"].update({path.name: record}))

