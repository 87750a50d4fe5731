"""Hostile files: a checkpoint is a directory, nothing outside it is read, and no corruption loads silently.

Every case of issue 10, plus a seeded fuzz loop of byte flips in safetensors headers and data. Each hostile input
must be refused with a message that names the bad file, except flipped data bytes loaded without verification;
with verification every one is refused. Reads outside the checkpoint are counted by inotify on the directory that
holds the bait files (any reader, Rust included). The module prints one line:

    M hostile files over K classes, 0 accepted (under verify), 0 read outside

Section 11 on (issue 20): special files, links out, memory bombs, headers the safetensors reader refuses, base config
values, config files under the checksums, the offloaded path's verification, and the one guarded opener.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import json
import math
import os
import random
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_ids, tiny_dense
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_moe.checkpoint as checkpoint
import hf_moe.checkpoint.commit as commit
from hf_moe import CheckpointError, MoEForCausalLM, convert_checkpoint, convert_to_moe, export_native
from hf_moe.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
COUNTS = {"hostile": 0, "outside": 0, "verify": 0}
CLASSES: set[str] = set()  # the tests that presented hostile files: one class of input each


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    """Print the module's one-line count once its tests have run, past pytest's output capture (so CI logs show it
    without -s or -rA)."""
    yield
    line = (f"test_hostile.py: {COUNTS['hostile']} hostile files over {len(CLASSES)} classes, {COUNTS['verify']} "
            f"accepted (under verify), {COUNTS['outside']} read outside")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print(f"\n{line}", flush=True)


# --------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------
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


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny llama MoE (4 experts in every layer, top-2: exportable as Mixtral), saved, with its reference logits."""
    directory = tmp_path_factory.mktemp("saved") / "moe"
    model = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, noise=0.05).eval()
    model.save_pretrained(directory)
    return directory, logits(model)


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
    shutil.copytree(source, destination, symlinks=True)
    return destination


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


# --------------------------------------------------------------------------------------------------------------
# 1. Path traversal: nothing outside the checkpoint is read
# --------------------------------------------------------------------------------------------------------------
def _points_outside(directory: Path, bait: Path, how: str) -> str:
    """Make `directory` reach for a valid expert file in `bait`, outside it; returns the file name to be named."""
    name = expert_file(directory).name
    target = bait / name
    shutil.copy(expert_file(directory), target)
    if how in ("relative", "absolute"):
        outside_name = f"../{bait.name}/{name}" if how == "relative" else str(target)
        expert_file(directory).unlink()
        edit_json(directory / checkpoint.INDEX_NAME, lambda index: index["weight_map"].update(
            {k: outside_name for k, v in index["weight_map"].items() if v == name}))
        return outside_name
    if how == "symlinked file":
        expert_file(directory).unlink()
        os.symlink(target, expert_file(directory))
        return name
    assert how == "symlinked config"
    shutil.move(directory / "config.json", bait / "config.json")
    os.symlink(bait / "config.json", directory / "config.json")
    return "config.json"


@pytest.mark.parametrize("how", ["relative", "absolute", "symlinked file", "symlinked config"])
def test_nothing_outside_the_checkpoint_is_read(saved, outside, tmp_path, capsys, how):
    """The index may not map keys to ../x or /abs/x, and no file may be a link out of the directory: loading,
    `hf-moe inspect`, `hf-moe verify` and `hf-moe export` refuse, naming the file, before reading the bait."""
    directory = copy_of(saved[0], tmp_path / "moe")
    named = _points_outside(directory, outside.directory, how)
    outside.arm()
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), named)
    if how != "symlinked config":  # (AutoModelForCausalLM reads config.json before handing over to hf_moe)
        refused(lambda: AutoModelForCausalLM.from_pretrained(directory), named)
    refused_under_verify(directory, named)
    for argv, status in ((["inspect", str(directory)], 2), (["verify", str(directory)], 1),
                         (["export", str(directory), str(tmp_path / "native")], 2)):
        capsys.readouterr()
        assert cli(argv) == status, argv
        assert named in capsys.readouterr().err, argv
    assert not (tmp_path / "native").exists()


def test_export_does_not_follow_a_tokenizer_link_out_of_the_checkpoint(saved, outside, tmp_path):
    directory = copy_of(saved[0], tmp_path / "moe")
    (outside.directory / "tokenizer.json").write_text("{}")
    os.symlink(outside.directory / "tokenizer.json", directory / "tokenizer.json")
    outside.arm()
    hostile()
    export_native(directory, tmp_path / "native", verify=False)
    assert (tmp_path / "native" / "config.json").is_file() and not (tmp_path / "native" / "tokenizer.json").exists()


@pytest.mark.parametrize("how", ["relative", "absolute", "symlinked file"])
def test_streaming_source_index_stays_inside_the_source(outside, tmp_path, how):
    dense = tmp_path / "dense"
    tiny_dense("llama").save_pretrained(dense, max_shard_size="40KB")
    shard = sorted(dense.glob("model-*.safetensors"))[1]
    bait = outside.directory / shard.name
    shutil.copy(shard, bait)
    shard.unlink()
    if how == "symlinked file":
        os.symlink(bait, shard)
        named = shard.name
    else:
        named = f"../{bait.parent.name}/{shard.name}" if how == "relative" else str(bait)
        edit_json(dense / "model.safetensors.index.json", lambda index: index["weight_map"].update(
            {k: named for k, v in index["weight_map"].items() if v == shard.name}))
    outside.arm()
    hostile()
    refused(lambda: convert_checkpoint(dense, tmp_path / "moe", 4, 2, progress=False), named)
    assert not (tmp_path / "moe").exists()


# --------------------------------------------------------------------------------------------------------------
# 2. Silent corruption
# --------------------------------------------------------------------------------------------------------------
def test_flipped_data_bytes_are_named_by_verification(saved, tmp_path, capsys):
    """Same size, valid header, one byte of a tensor flipped: loads only without verification (with other logits);
    verification (the default, `verify_checksums=True`, `hf-moe verify`, export) names the file and the tensor."""
    directory, expected = saved
    assert cli(["verify", str(directory)]) == 0
    assert "every checksum (xxh3_128) matches" in capsys.readouterr().out
    directory = copy_of(directory, tmp_path / "moe")
    path, tensor = directory / "model-00001-of-00001.safetensors", "lm_head.weight"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n + json.loads(raw[8 : 8 + n])[tensor]["data_offsets"][0] + 3] ^= 0x40  # a float's exponent
    path.write_bytes(raw)
    loaded = MoEForCausalLM.from_pretrained(directory, verify_checksums=False)
    assert not torch.equal(logits(loaded), expected)  # what would otherwise load silently
    refused(lambda: MoEForCausalLM.from_pretrained(directory), path.name, tensor)
    refused_under_verify(directory, path.name, tensor)
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    err = capsys.readouterr().err
    assert f"{path.name}: tensor {tensor}: its bytes differ" in err and err.count("differ") == 1, err
    assert cli(["export", str(directory), str(tmp_path / "native")]) == 2
    assert path.name in capsys.readouterr().err and not (tmp_path / "native").exists()
    hostile()


@pytest.mark.parametrize("checksums", [True, False])
def test_dtype_changed_in_a_header_at_the_same_size(saved, tmp_path, checksums):
    """F32 -> I32 keeps every size: refused by the header checksum, or (a checkpoint without checksums) by the
    dtypes expected from the config."""
    directory = copy_of(saved[0], tmp_path / "moe")
    if not checksums:
        without_checksums(directory)
    path = expert_file(directory)
    edit_header(path, lambda header: header[sorted(k for k in header if k != "__metadata__")[0]].update(dtype="I32"))
    hostile()
    message = refused(lambda: MoEForCausalLM.from_pretrained(directory), path.name)  # (checked on every load)
    assert ("header" in message) if checksums else ("as I32" in message)
    refused_under_verify(directory, path.name)


def test_bf16_read_as_f16_and_a_transposed_shape_are_refused_by_the_config(tmp_path):
    """Without checksums, the config still fixes every dtype and shape: BF16 bytes declared F16, or a [32, 64]
    k_proj declared [64, 32], would load as garbage."""
    model = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "moe")
    without_checksums(tmp_path / "moe")
    shard = tmp_path / "moe" / "model-00001-of-00001.safetensors"
    original = shard.read_bytes()
    edit_header(shard, lambda h: h["model.layers.0.self_attn.o_proj.weight"].update(dtype="F16"))
    hostile(2)
    refused(lambda: MoEForCausalLM.from_pretrained(tmp_path / "moe"), shard.name, "as F16")
    shard.write_bytes(original)
    edit_header(shard, lambda h: h["model.layers.1.self_attn.k_proj.weight"].update(shape=[64, 32]))
    refused(lambda: MoEForCausalLM.from_pretrained(tmp_path / "moe"), shard.name, "k_proj", "[64, 32]")


def test_a_router_full_of_nan_is_refused(tmp_path, capsys):
    model = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.fill_(math.nan)
    model.save_pretrained(tmp_path / "moe")  # checksums match: the file is as saved, and still unusable
    hostile()
    shard = "model-00001-of-00001.safetensors"
    refused(lambda: MoEForCausalLM.from_pretrained(tmp_path / "moe"), shard, "layers.1.mlp.gate.weight", "NaN")
    refused_under_verify(tmp_path / "moe", shard)
    assert cli(["export", str(tmp_path / "moe"), str(tmp_path / "native")]) == 2
    assert "NaN" in capsys.readouterr().err and not (tmp_path / "native").exists()


def test_verification_needs_recorded_checksums(saved, tmp_path):
    directory = copy_of(saved[0], tmp_path / "moe")
    without_checksums(directory)
    hostile(2)
    MoEForCausalLM.from_pretrained(directory)  # the default verifies what is recorded
    refused(lambda: MoEForCausalLM.from_pretrained(directory, verify_checksums=True), "records no checksums")
    edit_json(directory / checkpoint.INDEX_NAME, lambda index: index["metadata"].update(
        checksums={"algorithm": "md5", "files": {}}))
    refused(lambda: MoEForCausalLM.from_pretrained(directory), checkpoint.INDEX_NAME, "md5")


def _flip(path: Path, region: str, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    at = rng.randrange(0, 8 + n) if region == "header" else rng.randrange(8 + n, len(data))
    for i in range(rng.choice((1, 1, 2, 4))):
        if at + i < len(data):
            data[at + i] ^= rng.randrange(1, 256)
    path.write_bytes(data)


@pytest.mark.slow
def test_fuzzed_headers_and_data(saved, tmp_path):
    """240 seeded mutations (1-4 bytes XOR-ed, half in a header, half in tensor data, in a random file). Without
    verification a header mutation is refused naming the file and a data mutation loads (or is refused naming the
    file: a router made NaN); with verification every one is refused naming the file."""
    directory = copy_of(saved[0], tmp_path / "moe")
    files = sorted(directory.glob("*.safetensors"))
    originals = {p: p.read_bytes() for p in files}
    rng = random.Random(10)
    outcomes = {"header refused": 0, "data loaded": 0, "data refused": 0}
    for i in range(240):
        path, region = rng.choice(files), ("header", "data")[i % 2]
        _flip(path, region, rng)
        hostile()
        try:
            MoEForCausalLM.from_pretrained(directory, verify_checksums=False)
        except CheckpointError as err:
            assert path.name in str(err), (i, region, str(err))
            outcomes[f"{region} refused"] += 1
        else:
            assert region == "data", f"mutation {i} of the header of {path.name} was accepted"
            outcomes["data loaded"] += 1
        refused_under_verify(directory, path.name)
        path.write_bytes(originals[path])
    assert outcomes["header refused"] == 120 and outcomes["data loaded"] > 60, outcomes


# --------------------------------------------------------------------------------------------------------------
# 3. generate under expert parallelism with unequal lengths
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.slow
def test_generate_under_expert_parallelism_with_unequal_lengths(tmp_path):
    """Two gloo ranks generate 3 and 9 tokens from prompts of 4 and 9 tokens (greedy, then sampled): without
    synced_gpus the rank that is done leaves the other waiting in its next all_to_all forever."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "dist" / "ep_generate.py"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_MOE_BACKEND": "torch"}
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                               start_new_session=True)
    try:  # (each rank also ends itself after 180 s, printing where it hung)
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        process.terminate()  # torchrun stops its ranks on SIGTERM
        try:
            output, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output = ""
        pytest.fail(f"generate under expert parallelism hung (stopped after 240 s):\n{output[-3000:]}")
    assert process.returncode == 0, f"generate under expert parallelism failed or hung:\n{output[-4000:]}"
    assert "OK generate under EP=2" in output
    assert all((tmp_path / f"rank{r}.pt").is_file() for r in range(2))


# --------------------------------------------------------------------------------------------------------------
# 4, 5. Staging: stale ones removed safely, none left by a failing writer, bounded descriptors
# --------------------------------------------------------------------------------------------------------------
def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.hf_moe"))


def test_stale_staging_is_removed_by_the_next_save_and_a_live_writers_is_kept(saved, tmp_path):
    out = copy_of(saved[0], tmp_path / "out")
    dead = [out.parent / f".out.hf_moe-tmp-{'d' * 12}", out.parent / ".out.hf_moe-tmp-0badc0de",  # locked, legacy
            out.parent / f".out.hf_moe-old-{'e' * 12}"]
    for path in dead:
        copy_of(saved[0], path)
    (out.parent / f".out.hf_moe-{'d' * 12}.lock").touch()
    (out.parent / f".out.hf_moe-{'e' * 12}.lock").touch()
    live = copy_of(saved[0], out.parent / f".out.hf_moe-tmp-{'a' * 12}")
    lock = out.parent / f".out.hf_moe-{'a' * 12}.lock"
    lock.touch()
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl, os, sys, time\nfd = os.open({str(lock)!r}, os.O_RDWR)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        hostile()
        model = MoEForCausalLM.from_pretrained(out)
        model.save_pretrained(out)
        assert _leftovers(out) == sorted([live.name, lock.name])  # the live writer's staging and lock are kept
        assert (live / "config.json").is_file()
    finally:
        holder.kill()
        holder.wait()
    model.save_pretrained(out)
    assert _leftovers(out) == []
    assert torch.equal(logits(MoEForCausalLM.from_pretrained(out)), saved[1])


def _rlimit_allowing(extra: int) -> int:
    """A soft descriptor limit that leaves exactly `extra` descriptors free to this process."""
    used = {int(fd) for fd in os.listdir("/proc/self/fd")}
    limit = 0
    while sum(1 for fd in range(limit) if fd not in used) < extra or limit in used:
        limit += 1
    return limit


@pytest.mark.slow
def test_streaming_converts_128_experts_under_a_64_descriptor_limit(tmp_path):
    """The writer keeps a bounded number of files open; a writer that fails (EMFILE here) leaves no staging and no
    open descriptor."""
    import resource

    tiny_dense("llama", num_hidden_layers=1).save_pretrained(tmp_path / "dense")
    convert_checkpoint(tmp_path / "dense", tmp_path / "warm", 4, 2, progress=False)  # imports done before limiting
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = max(64, _rlimit_allowing(24))
    assert limit < 128, "this process holds too many descriptors for the test to mean anything"
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        convert_checkpoint(tmp_path / "dense", tmp_path / "moe", 128, 2, progress=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(list((tmp_path / "moe").glob("model-expert-*.safetensors"))) == 128
    MoEForCausalLM.from_pretrained(tmp_path / "moe")

    before = sorted(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (_rlimit_allowing(2), hard))
    try:
        with pytest.raises(OSError):
            convert_checkpoint(tmp_path / "dense", tmp_path / "failed", 128, 2, progress=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not (tmp_path / "failed").exists() and _leftovers(tmp_path / "failed") == []
    assert sorted(os.listdir("/proc/self/fd")) == before


# --------------------------------------------------------------------------------------------------------------
# 6. Symlinks and self-overwrite
# --------------------------------------------------------------------------------------------------------------
def test_out_as_a_symlink_updates_the_directory_it_names(saved, tmp_path):
    real = copy_of(saved[0], tmp_path / "real")
    os.symlink(real, tmp_path / "link")
    model = convert_to_moe(tiny_dense("llama", seed=1), num_experts=4, top_k=2)
    model.save_pretrained(tmp_path / "link")
    hostile()
    assert (tmp_path / "link").is_symlink() and os.readlink(tmp_path / "link") == str(real)
    assert torch.equal(logits(MoEForCausalLM.from_pretrained(real)), logits(model))
    assert _leftovers(real) == []


def test_symlink_loop_and_symlinked_subdirectory_inside_out(saved, tmp_path):
    out = copy_of(saved[0], tmp_path / "out")
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "data.bin").write_bytes(b"x" * 1000)
    os.symlink(tmp_path / "big", out / "runs")
    os.symlink("loop", out / "loop")
    hostile(2)
    MoEForCausalLM.from_pretrained(out).save_pretrained(out)
    assert (out / "runs").is_symlink() and os.readlink(out / "runs") == str(tmp_path / "big")  # not copied
    assert (out / "loop").is_symlink() and os.readlink(out / "loop") == "loop"
    assert _leftovers(out) == []


def test_convert_src_src_is_refused(tmp_path, capsys):
    dense = tmp_path / "dense"
    tiny_dense("llama").save_pretrained(dense)
    before = {p.name: p.read_bytes() for p in dense.iterdir()}
    for out in (dense, tmp_path / "x" / ".." / "dense"):
        (tmp_path / "x").mkdir(exist_ok=True)
        hostile()
        for extra in ([], ["--in-memory"]):
            assert cli(["convert", str(dense), str(out), "--num-experts", "4", "--top-k", "2", *extra]) == 2
            assert "is SRC" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in dense.iterdir()} == before
    with pytest.raises(ValueError, match="replace the dense model"):
        convert_checkpoint(dense, tmp_path / "x" / ".." / "dense", 4, 2)


def test_export_into_its_own_source_spelled_differently_is_refused(saved, tmp_path, capsys):
    directory = copy_of(saved[0], tmp_path / "moe")
    (tmp_path / "sub").mkdir()
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    hostile()
    assert cli(["export", str(directory), str(tmp_path / "sub" / ".." / "moe")]) == 2
    assert "Export to a new directory" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


# --------------------------------------------------------------------------------------------------------------
# 7. The commit window
# --------------------------------------------------------------------------------------------------------------
def test_save_swaps_the_directories_in_one_step(saved, tmp_path, monkeypatch):
    """Where renameat2(RENAME_EXCHANGE) exists, OUT is never absent: the commit is one exchange (a kill at every
    point of it is in test_faults.py)."""
    if commit._renameat2() is None:
        pytest.skip("no renameat2 on this platform")
    out = copy_of(saved[0], tmp_path / "out")
    before = out.stat().st_ino
    exchanges = []
    exchange = commit._exchange
    monkeypatch.setattr(commit, "_exchange", lambda a, b: exchanges.append(exchange(a, b)) or exchanges[-1])
    MoEForCausalLM.from_pretrained(out).save_pretrained(out)
    assert exchanges == [True] and out.stat().st_ino != before and _leftovers(out) == []


def test_a_commit_killed_between_its_two_renames_is_recovered_by_the_next_load(saved, tmp_path):
    """Without RENAME_EXCHANGE the commit is two renames; a kill between them leaves OUT absent and the previous
    model in .OUT.hf_moe-old-<token> (with a lock nobody holds): the next load puts it back, the next save cleans."""
    out = tmp_path / "out"
    token = "c0ffee" * 2
    copy_of(saved[0], tmp_path / f".out.hf_moe-old-{token}")
    copy_of(saved[0], tmp_path / f".out.hf_moe-tmp-{token}")
    (tmp_path / f".out.hf_moe-{token}.lock").touch()
    hostile()
    model = MoEForCausalLM.from_pretrained(out)
    assert torch.equal(logits(model), saved[1])
    model.save_pretrained(out)
    assert _leftovers(out) == []


def test_without_rename_exchange_the_two_renames_still_commit(saved, tmp_path, monkeypatch):
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    out = copy_of(saved[0], tmp_path / "out")
    model = convert_to_moe(tiny_dense("llama", seed=2), num_experts=4, top_k=2)
    model.save_pretrained(out)
    assert torch.equal(logits(MoEForCausalLM.from_pretrained(out)), logits(model)) and _leftovers(out) == []


# --------------------------------------------------------------------------------------------------------------
# 8. Streaming checks what it copies against the config
# --------------------------------------------------------------------------------------------------------------
def test_streaming_refuses_a_transposed_source_tensor(tmp_path, capsys):
    """A source header with k_proj [32, 64] declared [64, 32] (same bytes) used to convert with exit 0 into a model
    that does not load; a copied tensor or an MLP read from the source must have the config's shape and kind."""
    dense = tmp_path / "dense"
    tiny_dense("llama").save_pretrained(dense)
    path = dense / "model.safetensors"
    original = path.read_bytes()
    k_proj = "model.layers.1.self_attn.k_proj.weight"
    edit_header(path, lambda h: h[k_proj].update(shape=[64, 32]))
    hostile(3)
    refused(lambda: convert_checkpoint(dense, tmp_path / "moe", 4, 2, progress=False), path.name, k_proj, "[64, 32]")
    assert cli(["convert", str(dense), str(tmp_path / "moe"), "--num-experts", "4", "--top-k", "2"]) == 2
    assert "k_proj" in capsys.readouterr().err and not (tmp_path / "moe").exists()
    for key, change, text in ((k_proj, dict(dtype="I32"), "I32"),
                              ("model.layers.0.mlp.up_proj.weight", dict(shape=[64, 96]), "[64, 96]")):
        path.write_bytes(original)
        edit_header(path, lambda h: h[key].update(change))
        refused(lambda: convert_checkpoint(dense, tmp_path / "moe", 4, 2, progress=False), path.name, key, text)
    assert not (tmp_path / "moe").exists()


# --------------------------------------------------------------------------------------------------------------
# 9. The extension's build cache is keyed on the torch install
# --------------------------------------------------------------------------------------------------------------
def test_extension_cache_key_depends_on_the_torch_install(tmp_path):
    """Two environments with the same torch version (two venvs) get two cache entries, not one rebuilt in turn;
    rewriting torch's library in place changes the key too."""
    from hf_moe.ops.extension import source_hash

    installs = []
    for name in ("venv_a", "venv_b"):
        torch_dir = tmp_path / name / "torch"
        (torch_dir / "lib").mkdir(parents=True)
        (torch_dir / "lib" / "libtorch_cpu.so").write_bytes(b"same bytes")
        installs.append(torch_dir)
    keys = [source_hash(torch_dir=d) for d in installs]
    assert keys[0] != keys[1]
    os.utime(installs[0] / "lib" / "libtorch_cpu.so", ns=(1, 1))
    assert source_hash(torch_dir=installs[0]) != keys[0]
    assert source_hash() == source_hash(torch_dir=Path(torch.__file__).parent)


# --------------------------------------------------------------------------------------------------------------
# 10. Every value read from a file or an argument is checked, with a short message
# --------------------------------------------------------------------------------------------------------------
def test_capacity_factor_inf_on_the_command_line(tmp_path, capsys):
    tiny_dense("llama").save_pretrained(tmp_path / "dense")
    for value in ("inf", "nan", "-1"):
        assert cli(["convert", str(tmp_path / "dense"), str(tmp_path / "moe"), "--num-experts", "4", "--top-k", "2",
                    "--capacity-factor", value]) == 2
        assert "capacity_factor must be positive and finite" in capsys.readouterr().err
    assert not (tmp_path / "moe").exists()


@pytest.mark.parametrize("option", [dict(noise=math.nan), dict(router_aux_loss_coef=math.nan),
                                    dict(num_prototypes=0, router_type="prototype"), dict(reinit_fraction=math.nan),
                                    dict(router_jitter_noise=math.inf), dict(router_z_loss_coef=-1.0)])
def test_nan_and_out_of_range_options_are_refused(option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=name):
        convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, **option)


CONFIG_EDITS = {
    "num_experts as a string": ({"num_experts": "4"}, "num_experts must be an int"),
    "a million experts": ({"num_experts": 10**6}, "num_experts=1000000"),
    "capacity_factor inf": ({"capacity_factor": math.inf}, "capacity_factor must be positive and finite"),
    "aux loss NaN": ({"router_aux_loss_coef": math.nan}, "router_aux_loss_coef must be a finite number"),
    "zero prototypes": ({"num_prototypes": 0, "router_type": "prototype"}, "num_prototypes must be at least 1"),
    "a norm bypassed": ({"moe_bypassed_paths": ["post_attention_layernorm"]}, "post_attention_layernorm"),
    "string layers": ({"moe_layers": ["0", "1"]}, "moe_layers must be a list of ints"),
    "bool experts": ({"num_experts_per_tok": True}, "num_experts_per_tok must be an int"),
    "format as a string": ({"hf_moe_format": "1"}, "hf_moe_format='1'"),
    "unknown activation": ({"expert_hidden_act": "x" * 10**5}, "expert_hidden_act"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_EDITS))
def test_config_values_are_checked(saved, tmp_path, case):
    edit, text = CONFIG_EDITS[case]
    directory = copy_of(saved[0], tmp_path / "moe")
    edit_json(directory / "config.json", lambda config: config.update(edit))
    hostile()
    message = refused(lambda: MoEForCausalLM.from_pretrained(directory), "config.json", text)
    assert len(message) < 1000, len(message)
    refused_under_verify(directory, "config.json")


@pytest.mark.parametrize("case", ["list weight_map", "non-string file", "weight_map missing", "index not an object",
                                  "index not JSON", "bad checksums entry"])
def test_index_values_are_checked(saved, tmp_path, case):
    directory = copy_of(saved[0], tmp_path / "moe")
    index = directory / checkpoint.INDEX_NAME
    edits = {
        "list weight_map": lambda i: i.update(weight_map=list(i["weight_map"].items())),
        "non-string file": lambda i: i["weight_map"].update({next(iter(i["weight_map"])): ["a"]}),
        "weight_map missing": lambda i: i.pop("weight_map"),
        "bad checksums entry": lambda i: i["metadata"]["checksums"]["files"].update({"x": 3}),
    }
    if case == "index not an object":
        index.write_text("[1, 2]")
    elif case == "index not JSON":
        index.write_bytes(b"{\xff")
    else:
        edit_json(index, edits[case])
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), checkpoint.INDEX_NAME)
    refused_under_verify(directory, checkpoint.INDEX_NAME)


# --------------------------------------------------------------------------------------------------------------
# 11. The guarded opener (issue 20): special files, links out, memory bombs, headers the safetensors reader refuses
# --------------------------------------------------------------------------------------------------------------
class FifoWatchdog:
    """Opens the write end of FIFOs that a reader is blocked on (and closes it: the reader sees end of file), so a
    reader that does block ends instead of hanging the test. `blocked` counts the readers it freed."""

    def __init__(self, *paths: Path):
        import threading

        self.fifos = [p for p in paths if os.path.lexists(p) and stat.S_ISFIFO(os.lstat(p).st_mode)]
        self.blocked, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(0.05):
            for fifo in self.fifos:
                with contextlib.suppress(OSError):  # ENXIO: no reader has it open
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                    self.blocked += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _special_file(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:  # a character device: /dev/null (which reads as empty, so a reader that does not refuse it cannot hang)
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod of a character device is not permitted here")


@pytest.mark.parametrize("kind", ["fifo", "chardev"])
@pytest.mark.parametrize("name", ["config.json", checkpoint.INDEX_NAME, "generation_config.json",
                                  "model-expert-00001.safetensors"])
def test_special_files_are_refused_without_blocking(saved, tmp_path, capsys, name, kind):
    """A FIFO or a device where a checkpoint file belongs is refused, naming it, before any read: a FIFO would block
    the loader forever, /dev/zero would fill its memory."""
    directory = copy_of(saved[0], tmp_path / "moe")
    _special_file(directory / name, kind)
    what = "named pipe" if kind == "fifo" else "character device"
    hostile()
    with FifoWatchdog(directory / name) as watchdog:
        refused(lambda: MoEForCausalLM.from_pretrained(directory), name, what)
        capsys.readouterr()
        assert cli(["verify", str(directory)]) == 1
        assert what in capsys.readouterr().err
        refused(lambda: MoEForCausalLM.from_pretrained(directory, offload_experts="disk", max_expert_memory="1GB"),
                name, what)
    assert watchdog.blocked == 0  # no reader ever opened it


def test_a_symlinked_generation_config_is_not_read(saved, outside, tmp_path, capsys):
    """generation_config.json linked out of the checkpoint: transformers would read it with the model (and its values
    would land in model.generation_config); from_pretrained, the Auto classes and export refuse it first."""
    directory = copy_of(saved[0], tmp_path / "moe")
    bait = outside.directory / "generation_config.json"
    bait.write_text(json.dumps({"max_length": 4242, "bos_token_id": 1}))
    (directory / "generation_config.json").unlink()
    os.symlink(bait, directory / "generation_config.json")
    outside.arm()
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), "generation_config.json", "outside")
    refused(lambda: AutoModelForCausalLM.from_pretrained(directory), "generation_config.json", "outside")
    assert cli(["export", str(directory), str(tmp_path / "native")]) == 2
    assert "generation_config.json" in capsys.readouterr().err and not (tmp_path / "native").exists()


@pytest.mark.parametrize("how", ["symlinked tokenizer", "fifo tokenizer"])
def test_generate_reads_the_tokenizer_through_the_guard(saved, outside, tmp_path, capsys, how):
    from conftest import tiny_tokenizer

    directory = copy_of(saved[0], tmp_path / "moe")
    tiny_tokenizer().save_pretrained(directory)
    if how == "symlinked tokenizer":
        bait = outside.directory / "tokenizer.json"
        shutil.copy(directory / "tokenizer.json", bait)
        (directory / "tokenizer.json").unlink()
        os.symlink(bait, directory / "tokenizer.json")
    else:
        _special_file(directory / "tokenizer.json", "fifo")
    outside.arm()
    hostile()
    with FifoWatchdog(directory / "tokenizer.json") as watchdog:
        assert cli(["generate", str(directory), "hi", "--max-new-tokens", "2"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err and watchdog.blocked == 0


def _rewrite_header(path: Path, change) -> None:
    """Rewrite a safetensors file with `change(header_dict) -> bytes` as its header (any length; data unchanged)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = change(json.loads(raw[8 : 8 + n]))
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])


def _record_checksums(directory: Path, path: Path, tensors: bool = True) -> None:
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


def _with_zero_size(header: dict, shape, shape_text: str | None = None) -> bytes:
    header["zero"] = {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}
    text = json.dumps(header)
    return (text if shape_text is None else text.replace(json.dumps(shape), shape_text)).encode()


def _every_dtype(header: dict, dtype) -> bytes:
    return json.dumps({k: v if k == "__metadata__" else {**v, "dtype": dtype} for k, v in header.items()}).encode()


HEADER_CASES = {
    "byte-order mark": lambda h: codecs.BOM_UTF8 + json.dumps(h).encode(),
    "UTF-16": lambda h: json.dumps(h).encode("utf-16"),
    "zero-size, a dim past int64": lambda h: _with_zero_size(h, [0, 2**63]),
    "zero-size, overflowing before its 0": lambda h: _with_zero_size(h, [2**40, 2**40, 0]),
    "zero-size, negative zero": lambda h: _with_zero_size(h, [0, 5], "[-0, 5]"),
    "lone surrogate key": lambda h: _with_zero_size(h, [0]).replace(b'"zero"', b'"\\ud800"'),
    "dtype a list": lambda h: _every_dtype(h, ["F32"]),
    "dtype a dict": lambda h: _every_dtype(h, {"F32": 1}),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_headers_the_safetensors_reader_refuses_are_refused_first(saved, tmp_path, capsys, case):
    """Headers that passed hf_moe's checks but not the safetensors reader (verify said OK, loading raised a raw
    error naming no file), or crashed the checks (a list as dtype: unhashable): refused, naming the file, by the
    checks of every load and by `hf-moe verify`, even with checksums recorded to match (a consistent edit)."""
    directory = copy_of(saved[0], tmp_path / "moe")
    path = expert_file(directory)
    _rewrite_header(path, HEADER_CASES[case])
    _record_checksums(directory, path)
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), path.name)
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    assert path.name in capsys.readouterr().err


def _json_bomb(values: int) -> bytes:
    """A JSON object holding `values` empty lists (3 bytes each)."""
    return b'{"x": [' + b"[]," * (values - 1) + b"[]]}"


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize("where", ["header", "index", "config"])
def test_memory_bombs_are_refused_before_parsing(saved, tmp_path, where):
    """JSON that parses into millions of objects (a 99 MB header of empty lists took 25 s and 3 GB), or a config or
    an index past its size limit: refused at once, in bounded memory, naming the file."""
    import time

    directory = copy_of(saved[0], tmp_path / "moe")
    if where == "header":
        path = expert_file(directory)
        _rewrite_header(path, lambda h: _json_bomb(25_000_000))  # 75 MB
        _record_checksums(directory, path, tensors=False)
        named = path.name
    elif where == "index":  # a consistent index, with 3 million values of junk beside its entries
        index = json.loads((directory / checkpoint.INDEX_NAME).read_text())
        index["junk"] = [0] * 3_000_000
        (directory / checkpoint.INDEX_NAME).write_text(json.dumps(index))
        named = checkpoint.INDEX_NAME
    else:  # 20 MB of config: more than any model's (16 MB at most)
        edit_json(directory / "config.json", lambda config: config.update(notes="x" * 20_000_000))
        named = "config.json"
    hostile()
    before, start = _peak_rss_bytes(), time.perf_counter()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), named)
    assert time.perf_counter() - start < 10
    assert _peak_rss_bytes() - before < 400 << 20


def test_absurd_shared_experts_are_refused_before_any_allocation(saved, tmp_path, capsys):
    """num_shared_experts: 5000 in a checkpoint saved with none: verify said OK and loading allocated 1.45 GB before
    transformers noticed the missing tensors. The checks compare every tensor the config calls for with the index."""
    directory = copy_of(saved[0], tmp_path / "moe")
    edit_json(directory / "config.json", lambda config: config.update(num_shared_experts=5000))
    hostile()
    before = _peak_rss_bytes()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), "config.json", "shared_expert")
    assert _peak_rss_bytes() - before < 400 << 20
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1


BASE_VALUES = {
    "rms_norm_eps NaN": ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
    "rms_norm_eps -1": ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    "rope_theta NaN": ({"rope_parameters": {"rope_theta": math.nan, "rope_type": "default"}}, "rope_theta"),
    "attention_dropout 2": ({"attention_dropout": 2.0}, "attention_dropout"),
    "no attention heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "head_dim 0": ({"head_dim": 0}, "head_dim"),
    "vocab_size a string": ({"vocab_size": "256"}, "vocab_size"),
    "pad_token_id past the vocabulary": ({"pad_token_id": 10**6}, "pad_token_id"),
    "an attention implementation not installed": ({"_attn_implementation": "flash_attention_2"}, "config.json"),
    "a million layers": ({"num_hidden_layers": 10**6}, "num_hidden_layers"),
}


@pytest.mark.parametrize("case", sorted(BASE_VALUES))
def test_base_config_values_are_checked(saved, tmp_path, capsys, case):
    """The base model's values: NaN or negative epsilons and rope_theta loaded under verification and computed NaN
    (or silently other) logits; zero heads, a string vocabulary, a pad id past the vocabulary, an attention
    implementation that is not installed escaped as ZeroDivisionError, AssertionError, ImportError. Each is refused
    naming config.json and the field, by every load and by `hf-moe verify` (before any checksum: the message says
    what is wrong, not only that the file changed)."""
    edit, text = BASE_VALUES[case]
    directory = copy_of(saved[0], tmp_path / "moe")
    edit_json(directory / "config.json", lambda config: config.update(edit))
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained(directory), "config.json", text)
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err


@pytest.mark.parametrize("name,change", [
    ("config.json", lambda c: c.update(num_experts_per_tok=1)),
    ("config.json", lambda c: c.update(norm_topk_prob=False)),
    ("config.json", lambda c: c["auto_map"].update(AutoModelForCausalLM="other_module.Model")),
    ("generation_config.json", lambda c: c.update(max_length=7)),
    ("modeling_hf_moe.py", None),
])
def test_config_files_are_covered_by_the_checksums(saved, tmp_path, capsys, name, change):
    """config.json, generation_config.json and the auto_map shim decide what the weights compute: an edit is a changed
    checkpoint (verify used to say OK while the logits changed). `hf-moe verify --update` records an edit made on
    purpose, after which the checkpoint loads with it."""
    directory = copy_of(saved[0], tmp_path / "moe")
    if change is None:
        with open(directory / name, "a") as f:
            f.write("\nimport os  # an edit\n")
    else:
        edit_json(directory / name, change)
    hostile()
    message = refused(lambda: MoEForCausalLM.from_pretrained(directory), name, "hf-moe verify --update")
    assert "changed since the save" in message
    refused_under_verify(directory, name)
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    assert name in capsys.readouterr().err
    assert cli(["verify", "--update", str(directory)]) == 0
    assert name in capsys.readouterr().out
    if name == "config.json" and "auto_map" not in message:
        MoEForCausalLM.from_pretrained(directory)


# --------------------------------------------------------------------------------------------------------------
# 12. The offloaded path verifies what it reads, and notices files that change under it
# --------------------------------------------------------------------------------------------------------------
def _flip_every_tensor(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    for key, meta in json.loads(raw[8 : 8 + n]).items():
        if key != "__metadata__":
            raw[8 + n + meta["data_offsets"][0] + 3] ^= 0x40
    path.write_bytes(raw)


@pytest.mark.parametrize("mode", ["disk", "cpu"])
def test_offloaded_experts_are_verified(saved, tmp_path, capsys, mode):
    """One byte flipped in each tensor of an expert file: plain from_pretrained refused it, the offloaded loads ran
    the corrupted expert. Now each expert tensor is hashed at its first read ("cpu" reads them all at load)."""
    from conftest import tiny_tokenizer

    directory = copy_of(saved[0], tmp_path / "moe")
    path = expert_file(directory)
    _flip_every_tensor(path)
    hostile()

    def run():
        model = MoEForCausalLM.from_pretrained(directory, offload_experts=mode, max_expert_memory="1GB")
        logits(model)

    message = refused(run, path.name, "checksum")
    assert "model.layers." in message  # names the tensor
    refused(lambda: logits(MoEForCausalLM.from_pretrained(directory, offload_experts="disk", max_expert_memory="1GB",
                                                          verify_checksums=True)), path.name)
    if mode == "disk":
        tiny_tokenizer().save_pretrained(directory)
        capsys.readouterr()
        assert cli(["generate", str(directory), "abc", "--max-new-tokens", "4", "--offload-experts", "disk",
                    "--max-expert-memory", "1GB"]) == 2
        assert path.name in capsys.readouterr().err


def test_an_expert_file_overwritten_in_place_is_noticed(saved, tmp_path):
    """Offloaded generation read on after an expert file was overwritten in place (tokens changed, logits went
    non-finite, no error). Every read checks the file's size and modification time against those at load."""
    directory = copy_of(saved[0], tmp_path / "moe")
    other = tmp_path / "other"
    convert_to_moe(tiny_dense("llama", seed=3), num_experts=4, top_k=2, noise=0.05).save_pretrained(other)
    model = MoEForCausalLM.from_pretrained(directory, offload_experts="disk", max_expert_memory="150KB")  # 2 experts
    assert torch.allclose(logits(model), saved[1], atol=1e-5)
    for e in range(4):  # another model's expert files, written over these in place (same size)
        with open(expert_file(directory, e), "r+b") as f:
            f.write(expert_file(other, e).read_bytes())
    hostile()
    refused(lambda: logits(model), "changed on disk")


# --------------------------------------------------------------------------------------------------------------
# 13. One guarded opener: no read of a checkpoint file bypasses hf_moe/checkpoint/guard.py
# --------------------------------------------------------------------------------------------------------------
_READS = re.compile(r"\bopen\(|\.read_bytes\(|\.read_text\(|safe_open\(|load_file\(|torch\.load\(|shutil\.copy|"
                    r"copyfile\(|mmap\.mmap\(|fromfile\(")
# Every other read in the package, with why it is not a read of a checkpoint's file: (file, text of the line).
NOT_CHECKPOINT_FILES = {
    ("hf_moe/ops/extension.py", "h.update(path.read_bytes())"): "hashes hf_moe's C++ sources and torch's library",
    ("hf_moe/ops/extension.py", 'open(build_dir / "hf_moe-build.lock", "a")'): "the extension build cache's lock",
    ("hf_moe/ops/extension.py", "Path(spec.origin).read_bytes()"): "the compiled extension's own file",
    ("hf_moe/model_card.py", "(TEMPLATES / name).read_text()"): "the model card templates shipped in the package",
    ("hf_moe/offload/stats.py", 'open("/proc/self/status")'): "this process's memory statistics",
    ("hf_moe/inspect.py", "data_file.read_text("): "the text file named by `hf-moe inspect --data`",
    ("hf_moe/convert/merge_config.py", "path.read_text("): "the merge recipe (YAML) the user names, not a checkpoint",
    ("hf_moe/convert/stream.py", "os.open(self.directory / filename, flags"): "writes its own staging files",
    ("hf_moe/checkpoint/commit.py", "os.open(lock, "): "creates the writer's lock file beside OUT",
    ("hf_moe/checkpoint/commit.py", "os.open(_lock_path(target, token)"): "locks a writer's lock file beside OUT",
    ("hf_moe/checkpoint/commit.py", "shutil.copytree(src, dst"): "carries the old OUT's unrelated files (links them)",
    ("hf_moe/checkpoint/commit.py", "shutil.copy2(src, dst"): "carries an unrelated file where it cannot be linked",
    ("hf_moe/checkpoint/snapshot.py", "os.open(directory, os.O_RDONLY"): "opens the directory itself, to lock it",
    ("hf_moe/checkpoint/snapshot.py", "os.open(_turnstile(directory)"): "the readers' turnstile lock beside OUT",
    ("hf_moe/checkpoint/snapshot.py", "os.open(_turnstile(target)"): "the writers' turnstile lock beside OUT",
    ("hf_moe/parallel/training_state.py", "torch.load(io.BytesIO(data)"): "bytes read through the guard",
}


def test_every_read_of_a_checkpoint_file_goes_through_the_guard():
    """Greps the package for reads of files (open, read_bytes, read_text, safe_open, load_file, torch.load, copies,
    mappings): each is in hf_moe/checkpoint/guard.py, or allow-listed here with the reason it reads no checkpoint
    file. A new read of a checkpoint file must go through the guard (or come here with a reason)."""
    found, unused = [], dict(NOT_CHECKPOINT_FILES)
    for path in sorted((ROOT / "hf_moe").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == "hf_moe/checkpoint/guard.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not _READS.search(line) or line.lstrip().startswith("#"):
                continue
            key = next((k for k in NOT_CHECKPOINT_FILES if k[0] == relative and k[1] in line), None)
            if key is None:
                found.append(f"{relative}:{number}: {line.strip()}")
            unused.pop(key, None)
    assert not found, "reads that bypass hf_moe/checkpoint/guard.py:\n" + "\n".join(found)
    assert not unused, f"allow-list entries that match nothing any more: {sorted(unused)}"
