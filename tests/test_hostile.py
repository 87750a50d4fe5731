"""Hostile files: a checkpoint is a directory, nothing outside it is read, and no corruption loads silently.

Every case of issue 10, plus a seeded fuzz loop of byte flips in safetensors headers and data. Each hostile input
must be refused with a message that names the bad file, except flipped data bytes loaded without verification;
with verification every one is refused. Reads outside the checkpoint are counted by inotify on the directory that
holds the bait files (any reader, Rust included). The module prints one line:

    M hostile files over K classes, 0 accepted (under verify), 0 read outside; H loads by Hub id exact, E size
    estimates within 1%

Section 11 on (issue 20): special files, links out, memory bombs, headers the safetensors reader refuses, base config
values, config files under the checksums, the offloaded path's verification, and the one guarded opener.

Section 14 on (issue 28): checkpoints named by Hub id (a Hugging Face cache laid out as huggingface_hub writes it),
int8 experts' scales, hostile merge recipes, and conversions too large for the disk or the memory.
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
from conftest import hub_cache, random_ids, tiny_dense
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_moe.checkpoint as checkpoint
import hf_moe.checkpoint.commit as commit
from hf_moe import CheckpointError, MoEForCausalLM, convert_checkpoint, convert_to_moe, export_native
from hf_moe.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
COUNTS = {"hostile": 0, "outside": 0, "verify": 0, "hub": 0, "estimates": 0}
CLASSES: set[str] = set()  # the tests that presented hostile files: one class of input each


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    """Print the module's one-line count once its tests have run, past pytest's output capture (so CI logs show it
    without -s or -rA)."""
    yield
    line = (f"test_hostile.py: {COUNTS['hostile']} hostile files over {len(CLASSES)} classes, {COUNTS['verify']} "
            f"accepted (under verify), {COUNTS['outside']} read outside; {COUNTS['hub']} loads by Hub id exact, "
            f"{COUNTS['estimates']} size estimates within 1%")
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
    "eos_token_id a string": ({"eos_token_id": "2"}, "eos_token_id"),
    "bos_token_id a float": ({"bos_token_id": 1.5}, "bos_token_id"),
    "an attention implementation not installed": ({"_attn_implementation": "flash_attention_2"}, "config.json"),
    "a million layers": ({"num_hidden_layers": 10**6}, "num_hidden_layers"),
}


@pytest.mark.parametrize("case", sorted(BASE_VALUES))
def test_base_config_values_are_checked(saved, tmp_path, capsys, case):
    """The base model's values: NaN or negative epsilons and rope_theta loaded under verification and computed NaN
    (or silently other) logits; zero heads, a string vocabulary, a token id that is no int, an attention
    implementation that is not installed escaped as ZeroDivisionError, AssertionError, ImportError. (A token id past
    the vocabulary loads, as in transformers: tests/test_families.py.) Each is refused
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


@pytest.mark.parametrize("mtime", ["changed", "restored (cp -p)"])
def test_an_expert_file_overwritten_in_place_is_noticed(saved, tmp_path, mtime):
    """Offloaded generation read on after an expert file was overwritten in place (tokens changed, logits went
    non-finite, no error); with the modification time put back, as `cp -p` does, the size-and-mtime check let it
    through (issue 28). Every read checks the file's size, modification time and inode change time against those at
    load. A save that replaces the directory (unlinking the old files: their change time moves too) is not a change."""
    directory = copy_of(saved[0], tmp_path / "moe")
    other = tmp_path / "other"
    convert_to_moe(tiny_dense("llama", seed=3), num_experts=4, top_k=2, noise=0.05).save_pretrained(other)
    model = MoEForCausalLM.from_pretrained(directory, offload_experts="disk", max_expert_memory="150KB")  # 2 experts
    assert torch.allclose(logits(model), saved[1], atol=1e-5)
    if mtime != "changed":  # a save into the directory meanwhile: the model reads on from the files it opened
        MoEForCausalLM.from_pretrained(other).save_pretrained(directory)
        assert torch.allclose(logits(model), saved[1], atol=1e-5)
        directory = copy_of(saved[0], tmp_path / "moe2")
        model = MoEForCausalLM.from_pretrained(directory, offload_experts="disk", max_expert_memory="150KB")
        assert torch.allclose(logits(model), saved[1], atol=1e-5)
    for e in range(4):  # another model's expert files, written over these in place (same size)
        path = expert_file(directory, e)
        before = os.stat(path)
        with open(path, "r+b") as f:
            f.write(expert_file(other, e).read_bytes())
        if mtime != "changed":
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
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
    ("hf_moe/convert/merge_config.py", 'open(path, "rb")'): "the start of a calibration text file the recipe names",
    ("hf_moe/convert/stream.py", "os.open(self.directory / filename, flags"): "writes its own staging files",
    ("hf_moe/checkpoint/commit.py", "os.open(lock, "): "creates the writer's lock file beside OUT",
    ("hf_moe/checkpoint/commit.py", "os.open(_lock_path(target, token)"): "locks a writer's lock file beside OUT",
    ("hf_moe/checkpoint/commit.py", "shutil.copytree(src, dst"): "carries the old OUT's unrelated files (links them)",
    ("hf_moe/checkpoint/commit.py", "shutil.copy2(src, dst"): "carries an unrelated file where it cannot be linked",
    ("hf_moe/checkpoint/commit.py", "os.open(staging, "): "writes a file's staged replacement (replace_file)",
    ("hf_moe/convert/estimate.py", 'open("/proc/meminfo")'): "the machine's available memory",
    ("hf_moe/convert/estimate.py", 'open("/sys/fs/cgroup/memory.max")'): "this cgroup's memory limit",
    ("hf_moe/convert/estimate.py", 'open("/sys/fs/cgroup/memory.current")'): "this cgroup's memory use",
    ("hf_moe/checkpoint/snapshot.py", "os.open(directory, os.O_RDONLY"): "opens the directory itself, to lock it",
    ("hf_moe/checkpoint/snapshot.py", "os.open(_turnstile(directory)"): "the readers' turnstile lock beside OUT",
    ("hf_moe/checkpoint/snapshot.py", "os.open(_turnstile(target)"): "the writers' turnstile lock beside OUT",
    ("hf_moe/parallel/training_state.py", "torch.load(io.BytesIO(data)"): "bytes read through the guard",
    ("hf_moe/ops/extension.py", "float(path.read_text()"): "the build cache's record of the last build's seconds",
    ("hf_moe/shrink/calibration.py", "path.read_text(errors="): "the calibration text the user names (--data)",
    ("hf_moe/gpu_check/record.py", "json.loads(path.read_text())"): "gpu_check's own results.json (--out)",
    ("hf_moe/gpu_check/runner.py", 'open(output, "w")'): "writes a step's output file in gpu_check's --out",
    ("hf_moe/gpu_check/runner.py", "output.read_text(errors="): "reads back a step's output file (--out)",
    ("hf_moe/gpu_check/runner.py", 'open(log, "a")'): "appends to gpu_check's logs.txt (--out)",
    ("hf_moe/gpu_check/steps.py", "json.loads(found.read_text())"): "gpu_check's kernel launch counts (temp dir)",
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


# --------------------------------------------------------------------------------------------------------------
# 14. A checkpoint named by its Hub id (issue 28): resolved to its snapshot in the cache, then checked as any directory
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline, which huggingface_hub (so `hf-moe`) uses by default."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_loads_from_its_cached_snapshot_after_the_checks(saved, hub, capsys):
    """The cache's layouts transformers reads: refs/main, another branch, a commit hash as revision, a subfolder,
    an explicit cache_dir; by from_pretrained, the Auto class, the offloaded load and every command."""
    from conftest import tiny_tokenizer

    source = copy_of(saved[0], hub.parent / "src")
    tiny_tokenizer().save_pretrained(source)
    snapshot = hub_cache(source, hub)
    hub_cache(source, hub, revision="dev")
    hub_cache(source, hub, repo="org/nested", subfolder="moe")
    model = MoEForCausalLM.from_pretrained("org/moe")
    assert torch.equal(logits(model), saved[1]) and model.config.name_or_path == "org/moe"
    for kwargs in ({"revision": "dev"}, {"revision": snapshot.name}, {"cache_dir": str(hub)}):
        assert torch.equal(logits(MoEForCausalLM.from_pretrained("org/moe", **kwargs)), saved[1]), kwargs
    assert torch.equal(logits(MoEForCausalLM.from_pretrained("org/nested", subfolder="moe")), saved[1])
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained("org/moe", cache_dir=str(hub))), saved[1])
    offloaded = MoEForCausalLM.from_pretrained("org/moe", offload_experts="disk", max_expert_memory="1GB")
    assert torch.allclose(logits(offloaded), saved[1], atol=1e-5)
    capsys.readouterr()
    assert cli(["verify", "org/moe"]) == 0
    assert cli(["inspect", "org/moe"]) == 0
    assert cli(["generate", "org/moe", "abc", "--max-new-tokens", "2"]) == 0
    COUNTS["hub"] += 10  # (refs/main, a branch, a commit, cache_dir, a subfolder, Auto, offloaded, 3 commands)
    assert "Traceback" not in capsys.readouterr().err
    assert cli(["verify", "--update", "org/moe"]) == 2  # (the cache is not the user's to edit)
    assert "Hugging Face cache" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="not a local directory, and the Hugging Face cache"):
        MoEForCausalLM.from_pretrained("org/absent")


def _blob(snapshot: Path, name: str) -> Path:
    return Path(os.path.realpath(snapshot / name))


def _flip_blob_byte(snapshot: Path) -> str:
    blob = _blob(snapshot, expert_file(snapshot).name)
    raw = bytearray(blob.read_bytes())
    raw[-5] ^= 0x10
    blob.write_bytes(raw)
    return expert_file(snapshot).name


def _edit_blob_config(snapshot: Path) -> str:
    edit_json(_blob(snapshot, "config.json"), lambda config: config.update(num_experts_per_tok=1))
    return "config.json"


def _ref_out_of_the_repository(snapshot: Path) -> str:
    """refs/main names `snapshots/../../outside`: a checkpoint in the cache's root, outside the repository."""
    (snapshot.parents[1] / "refs" / "main").write_text("../../outside")
    shutil.copytree(snapshot, snapshot.parents[2] / "outside")
    return "refs are damaged"


HUB_CASES = {"a flipped weight byte": _flip_blob_byte, "an edited config.json": _edit_blob_config,
             "a ref that leaves the repository": _ref_out_of_the_repository}


@pytest.mark.parametrize("case", sorted(HUB_CASES))
def test_a_hub_id_gets_every_check_a_directory_gets(saved, hub, capsys, case):
    """By Hub id, from_pretrained ran none of the checks (they ran `if os.path.isdir(...)`): a flipped weight byte
    loaded under verify_checksums=True, an edited config.json loaded. The id is resolved to its snapshot first; the
    same snapshot by path and by id are refused alike, by from_pretrained and by `hf-moe verify`."""
    snapshot = hub_cache(saved[0], hub)
    named = HUB_CASES[case](snapshot)
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained("org/moe", verify_checksums=True), named)
    refused(lambda: logits(MoEForCausalLM.from_pretrained("org/moe", offload_experts="disk",
                                                          max_expert_memory="1GB")), named)
    capsys.readouterr()
    assert cli(["verify", "org/moe"]) in (1, 2)  # 1: damaged; 2: the id names no checkpoint
    assert named in capsys.readouterr().err


def test_int8_experts_by_hub_id_are_refused_as_floats_and_load_with_load_quantized(saved, hub, tmp_path, capsys):
    """By Hub id, an int8 checkpoint loaded silently as a float model holding the raw int8 integers (logits off by
    0.81, another argmax), and load_quantized("org/name") answered "has no config.json"."""
    from conftest import tiny_tokenizer

    import hf_moe

    model = hf_moe.quantize_experts(MoEForCausalLM.from_pretrained(saved[0]), "int8")
    hf_moe.save_quantized(model, tmp_path / "int8")
    tiny_tokenizer().save_pretrained(tmp_path / "int8")
    hub_cache(tmp_path / "int8", hub, repo="org/int8")
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained("org/int8"), "load_quantized")
    assert torch.equal(logits(hf_moe.load_quantized("org/int8")), logits(model))
    capsys.readouterr()
    assert cli(["generate", "org/int8", "abc", "--max-new-tokens", "2"]) == 0
    assert cli(["verify", "org/int8"]) == 0
    COUNTS["hub"] += 3  # (load_quantized, generate, verify)


# --------------------------------------------------------------------------------------------------------------
# 15. int8 experts (issue 28): their scales checked by every load and by verify, and written only when sound
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quantized(saved, tmp_path_factory):
    """The saved model with int8 experts (save_quantized, with a tokenizer), and its logits."""
    from conftest import tiny_tokenizer

    import hf_moe

    directory = tmp_path_factory.mktemp("int8") / "moe"
    model = hf_moe.quantize_experts(MoEForCausalLM.from_pretrained(saved[0]), "int8")
    hf_moe.save_quantized(model, directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory, logits(model)


def _set_scale(path: Path, value: float) -> str:
    """Set the first int8 scale of the file's first `_scale` tensor to `value` (F32, in place); returns its key."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    key, meta = next((k, m) for k, m in sorted(json.loads(raw[8 : 8 + n]).items()) if k.endswith("_scale"))
    struct.pack_into("<f", raw, 8 + n + meta["data_offsets"][0], value)
    path.write_bytes(raw)
    return key


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.5])
def test_int8_scales_that_are_nan_inf_or_negative_are_refused_everywhere(quantized, tmp_path, capsys, value):
    """load_quantized and `hf-moe generate` refused them; the offloaded loads ("disk" and "cpu") and `generate
    --offload-experts` ran them into non-finite logits, and verify said OK (the checksums recorded to match, as when
    save_quantized wrote them). Now every path refuses them, naming the file and the tensor."""
    import hf_moe

    directory = copy_of(quantized[0], tmp_path / "int8")
    path = expert_file(directory)
    key = _set_scale(path, value)
    _record_checksums(directory, path)
    hostile()
    refused(lambda: hf_moe.load_quantized(directory), path.name)
    for mode in ("disk", "cpu"):
        refused(lambda: logits(MoEForCausalLM.from_pretrained(directory, offload_experts=mode,
                                                              max_expert_memory="1GB")), key)
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    assert key in capsys.readouterr().err
    assert cli(["generate", str(directory), "abc", "--max-new-tokens", "2", "--offload-experts", "disk",
                "--max-expert-memory", "1GB"]) == 2
    assert key in capsys.readouterr().err


def test_save_quantized_writes_no_non_finite_scales(saved, tmp_path):
    """Experts quantized from weights that are not finite (a diverged run) get NaN or inf scales: save_quantized wrote
    them. Now the save refuses, and nothing is written."""
    import hf_moe

    model = MoEForCausalLM.from_pretrained(saved[0])
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[2, 0, 0] = math.inf
    hf_moe.quantize_experts(model, "int8")
    hostile()
    refused(lambda: hf_moe.save_quantized(model, tmp_path / "int8"), "down_proj_scale", error=ValueError)
    refused(lambda: model.save_pretrained(tmp_path / "int8"), "down_proj_scale", error=ValueError)
    assert not (tmp_path / "int8").exists() and not _leftovers(tmp_path / "int8")


def test_save_pretrained_of_an_int8_model_writes_what_load_quantized_reads(quantized, saved, tmp_path, capsys):
    """save_pretrained of an int8 model wrote the fused int8 buffers into the non-expert file: a checkpoint nothing
    loaded, which verify called OK. It writes what save_quantized writes now (one file per expert), bit for bit."""
    import hf_moe

    model = hf_moe.quantize_experts(MoEForCausalLM.from_pretrained(saved[0]), "int8")
    model.save_pretrained(tmp_path / "int8")
    for name in sorted(p.name for p in quantized[0].glob("*.safetensors")):
        assert load_file(tmp_path / "int8" / name).keys() == load_file(quantized[0] / name).keys(), name
        assert all(torch.equal(t, load_file(quantized[0] / name)[k]) for k, t in load_file(tmp_path / "int8" / name)
                   .items()), name
    assert torch.equal(logits(hf_moe.load_quantized(tmp_path / "int8")), quantized[1])
    capsys.readouterr()
    assert cli(["verify", str(tmp_path / "int8")]) == 0


@pytest.mark.parametrize("group_size", [0, -32, 48, "32"])
def test_a_bad_int8_group_size_is_named(saved, tmp_path, group_size):
    """group_size=0 escaped as a bare ZeroDivisionError (from quantize_experts, and from config.json at load)."""
    import hf_moe

    model = MoEForCausalLM.from_pretrained(saved[0])
    refused(lambda: hf_moe.quantize_experts(model, "int8", group_size=group_size), "group_size", error=ValueError)


def test_a_bad_int8_group_size_in_config_json_is_named(quantized, tmp_path):
    import hf_moe

    directory = copy_of(quantized[0], tmp_path / "int8")
    edit_json(directory / "config.json", lambda config: config["expert_quantization"].update(group_size=0))
    from hf_moe.checkpoint import record_config_files

    record_config_files(directory)
    hostile()
    refused(lambda: hf_moe.load_quantized(directory), "config.json", "group_size")
    refused(lambda: MoEForCausalLM.from_pretrained(directory, offload_experts="disk", max_expert_memory="1GB"),
            "config.json", "group_size")


# --------------------------------------------------------------------------------------------------------------
# 16. Merge recipes (issue 28): non-finite scales, alias bombs, deep nesting, bad dtypes, empty calibration text
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dense_sources(tmp_path_factory):
    """A tiny base Llama and two 'fine-tunes' of it (other seeds), each with a tokenizer."""
    from conftest import tiny_tokenizer

    root = tmp_path_factory.mktemp("dense")
    paths = []
    for seed in range(3):
        tiny_dense("llama", seed=seed).save_pretrained(root / f"m{seed}")
        tiny_tokenizer().save_pretrained(root / f"m{seed}")
        paths.append(str(root / f"m{seed}"))
    return paths


def _merge_yaml(path: Path, sources: list[str], first: str = "", top: str = "", gate_mode: str = "random",
                dtype: str = "float32", second: str = "") -> Path:
    """A mergekit-moe recipe over `sources` (base, then two experts): `first` and `second` are more lines of each
    expert's mapping, `top` more top-level lines."""
    path.write_text(f"base_model: {sources[0]}\ngate_mode: {gate_mode}\ndtype: {dtype}\n{top}experts:\n"
                    f"  - source_model: {sources[1]}\n{first}  - source_model: {sources[2]}\n{second}")
    return path


def _alias_bomb(levels: int) -> str:
    """A flow list whose last item expands to 9**levels strings, in a few hundred bytes of YAML."""
    items = ["&a0 [" + ", ".join(["lol"] * 9) + "]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


_PROMPTS = ("    positive_prompts: [the quick brown fox]\n", "    positive_prompts: [a mixture of experts]\n")
# case -> (_merge_yaml's keyword arguments, the field the error names)
MERGE_CASES = {
    "residual_scale .nan": (dict(first="    residual_scale: .nan\n"), "residual_scale"),
    "noise_scale .inf": (dict(first="    noise_scale: .inf\n"), "noise_scale"),
    "residual_scale 1e300": (dict(first="    residual_scale: 1.0e+300\n"), "residual_scale"),
    "an alias bomb in a field": (dict(first=f"    positive_prompts: {_alias_bomb(8)}\n"), "positive_prompts"),
    "a list nested 3000 deep": (dict(top="layers: " + "[" * 3000 + "]" * 3000 + "\n"), "nests"),
    "hidden_dtype: banana": (dict(top="hidden_dtype: banana\n", gate_mode="hidden", first=_PROMPTS[0],
                                  second=_PROMPTS[1]), "hidden_dtype"),
    "dtype: int8": (dict(dtype="int8"), "dtype"),
    "seed: 2**70": (dict(top=f"seed: {2**70}\n"), "seed"),
}


@pytest.mark.parametrize("case", sorted(MERGE_CASES))
def test_hostile_merge_recipes_are_refused_at_once(dense_sources, tmp_path, capsys, case):
    """`hf-moe merge` wrote NaN/inf experts for residual_scale .nan, noise_scale .inf or 1e300 (and its parity line said
    0.00e+00); a 700-byte alias bomb cost 50-90 s and 4 GB in a message's repr, then a MemoryError; a deep list, a
    dtype named banana (or int8) and a seed past 2**64 ended in tracebacks or torch's "Overflow when unpacking long
    long". Each is refused at once, naming the field, and nothing is written."""
    import time

    kwargs, named = MERGE_CASES[case]
    recipe = _merge_yaml(tmp_path / "merge.yml", dense_sources, **kwargs)
    hostile()
    capsys.readouterr()
    start = time.perf_counter()
    assert cli(["merge", str(recipe), str(tmp_path / "out")]) == 2
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err and len(err) < 3000, err[-3000:]
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path / "out")


@pytest.mark.parametrize("scale", ["noise_scale: 1.0e+19", "residual_scale: 1.0e+300"])
def test_a_merged_expert_that_overflows_is_refused_not_reported_as_exact(dense_sources, tmp_path, capsys,
                                                                         monkeypatch, scale):
    """Past the recipe's bounds (lifted here): noise of 1e19 gives finite weights whose outputs overflow, and the parity
    check (max(0.0, nan) is 0.0) printed "reproduces its source model's MLP within 0.00e+00"; a residual_scale of 1e300
    gives infinite weights, which were written. Each expert is checked as written, and nothing is."""
    import hf_moe.convert.merge_config as merge_config

    monkeypatch.setattr(merge_config, "MAX_SCALE", math.inf, raising=False)
    recipe = _merge_yaml(tmp_path / "merge.yml", dense_sources, f"    {scale}\n")
    hostile()
    capsys.readouterr()
    assert cli(["merge", str(recipe), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "experts[0]" in err and "layer 0" in err and scale.split(":")[0] in err, err[-2000:]
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path / "out")


@pytest.mark.parametrize("value", [math.nan, -math.inf])
def test_verify_names_an_expert_that_holds_nan_saved_with_matching_checksums(saved, tmp_path, capsys, value):
    """A checkpoint saved with non-finite experts (a bad merge or a diverged run: its checksums match) loaded and
    computed NaN, and `hf-moe verify` said OK. Verify counts every floating tensor's NaN and infinite values in its
    pass over the bytes, and names each tensor that holds any."""
    directory = copy_of(saved[0], tmp_path / "moe")
    path = expert_file(directory, 2)
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    key, meta = next((k, m) for k, m in sorted(json.loads(raw[8 : 8 + n]).items()) if k.endswith("down_proj"))
    struct.pack_into("<f", raw, 8 + n + meta["data_offsets"][0] + 4 * 7, value)
    path.write_bytes(raw)
    _record_checksums(directory, path)
    hostile()
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    err = capsys.readouterr().err
    assert f"{path.name}: tensor '{key}' holds 1 NaN or infinite value(s)" in err, err


def test_a_source_mlp_that_holds_nan_is_named(dense_sources, tmp_path, capsys):
    """A source whose MLP holds NaN was refused as "could not reproduce its output (max abs difference nan)": as if
    its forward were unusual. The merge now says what is wrong, naming the source and the layer."""
    from transformers import AutoModelForCausalLM as Dense

    broken = tmp_path / "broken"
    model = Dense.from_pretrained(dense_sources[1])
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = math.nan
    model.save_pretrained(broken)
    shutil.copy(Path(dense_sources[1]) / "tokenizer.json", broken)
    shutil.copy(Path(dense_sources[1]) / "tokenizer_config.json", broken)
    recipe = _merge_yaml(tmp_path / "merge.yml", [dense_sources[0], str(broken), dense_sources[2]])
    hostile()
    capsys.readouterr()
    assert cli(["merge", str(recipe), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{broken}, layer 1" in err and "NaN" in err, err[-2000:]
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path / "out")


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_empty_calibration_text_is_named(dense_sources, tmp_path, capsys, content):
    """An empty calibration_data file ended in datasets' DatasetGenerationError traceback."""
    empty, text = tmp_path / "domain.txt", tmp_path / "other.txt"
    empty.write_text(content)
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    recipe = _merge_yaml(tmp_path / "merge.yml", dense_sources, f"    calibration_data: {empty}\n",
                         gate_mode="calibration", second=f"    calibration_data: {text}\n")
    hostile()
    capsys.readouterr()
    assert cli(["merge", str(recipe), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert empty.name in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------------------
# 17. Conversions that cannot fit (issue 28): refused before any work, with the numbers
# --------------------------------------------------------------------------------------------------------------
def test_a_conversion_to_2_to_the_40_experts_is_refused_at_once(dense_sources, tmp_path):
    """2**40 experts kept growing (memory, files) until the machine gave out; 100000 experts of a 0.4 MB model streamed
    22 GB in 100,004 files. The output is estimated from the dense model first, streaming and in memory. (In a child
    process with 4 GB of address space and a timeout: what failed here would otherwise take the machine with it.)"""
    out = tmp_path / "out"
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
            "from hf_moe.cli import main; "
            "argv = ['convert', sys.argv[1], sys.argv[2], '--num-experts', str(2**40), '--top-k', '2']; "
            "print('exit', main(argv), main(argv + ['--in-memory']), file=sys.stderr)")
    env = {**os.environ, "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    hostile(2)
    result = subprocess.run([sys.executable, "-c", code, dense_sources[0], str(out)], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=300)
    assert "exit 2 2" in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("HF_MOE_SKIP_SIZE_CHECK") == 2 and "244.0 PB in 1,099,511,627,783 files" in (
        result.stderr), result.stderr[-3000:]
    assert "more than the dense model" in result.stderr  # (the in-memory estimate)
    assert not out.exists() and not _leftovers(out)


def test_a_conversion_larger_than_the_free_space_or_memory_is_refused(dense_sources, tmp_path, capsys, monkeypatch):
    """512 experts of the tiny model (~110 MB) against 50 MB free, and in memory against 50 MB available: refused
    with the sizes; HF_MOE_SKIP_SIZE_CHECK=1 goes ahead."""
    import hf_moe.convert.estimate as estimate

    monkeypatch.setattr(estimate, "free_space", lambda where: (50 << 20, None))
    monkeypatch.setattr(estimate, "available_memory", lambda: 50 << 20)
    out = tmp_path / "out"
    hostile(2)
    capsys.readouterr()
    assert cli(["convert", dense_sources[0], str(out), "--num-experts", "512", "--top-k", "2"]) == 2
    err = capsys.readouterr().err
    assert "MB" in err and "512 experts x 3 MoE layer(s)" in err and "52.4 MB free" in err, err
    refused(lambda: convert_to_moe(tiny_dense("llama"), num_experts=512, top_k=2), "52.4 MB of memory is available",
            "convert_checkpoint", error=ValueError)
    assert not out.exists() and not _leftovers(out)
    monkeypatch.setenv("HF_MOE_SKIP_SIZE_CHECK", "1")
    assert cli(["convert", dense_sources[0], str(out), "--num-experts", "8", "--top-k", "2"]) == 0
    assert MoEForCausalLM.from_pretrained(out).config.num_experts == 8


def test_the_size_estimate_matches_what_is_written(dense_sources, tmp_path):
    """The estimate (bytes, files) against the checkpoint a conversion writes: within 1% of its tensors' bytes
    (headers, index, config and card are the rest), and its file count."""
    from hf_moe.convert.adapters import extract_mlp, find_decoder_layers, find_mlp
    from hf_moe.convert.api import _expert_sizes
    from hf_moe.convert.estimate import estimate_conversion

    for method, experts, shared in (("upcycle", 8, 1), ("split", 4, 0)):
        out = tmp_path / f"{method}-{experts}-{shared}"
        dense = tiny_dense("llama")
        _, layers = find_decoder_layers(dense)
        mlp = extract_mlp(layers[0], find_mlp(layers[0]), dense.config)
        sizes = _expert_sizes(method, mlp, experts, shared)
        size = estimate_conversion(sum(p.numel() * 4 for p in dense.parameters()), mlp, sizes, experts, len(layers),
                                   shared, 4, 5 << 30)
        convert_checkpoint(dense_sources[0], out, experts, 2, method=method, num_shared_experts=shared, progress=False)
        weights = sum(m["data_offsets"][1] - m["data_offsets"][0] for path in out.glob("*.safetensors")
                      for k, m in checkpoint.read_safetensors_header(path).items() if k != "__metadata__")
        assert abs(size.output_bytes - weights) < 0.01 * weights, (method, size, weights)
        assert size.files - 6 == len(list(out.glob("*.safetensors"))), (method, size.files)
        COUNTS["estimates"] += 1
