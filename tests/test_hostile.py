"""Hostile files: a checkpoint is a directory, nothing outside it is read, and no corruption loads silently.

Every case of issue 10, plus a seeded fuzz loop of byte flips in safetensors headers and data. Each hostile input
must be refused with a message that names the bad file, except flipped data bytes loaded without verification;
with verification every one is refused. Reads outside the checkpoint are counted by inotify on the directory that
holds the bait files (any reader, Rust included). The module prints one line:

    M hostile files, 0 read outside, 0 accepted under verify
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import random
import shutil
import signal
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


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    """Print the module's one-line count once its tests have run, past pytest's output capture (so CI logs show it
    without -s or -rA)."""
    yield
    line = (f"test_hostile.py: {COUNTS['hostile']} hostile files, {COUNTS['outside']} read outside, "
            f"{COUNTS['verify']} accepted under verify")
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
    """Count hostile files (or directories) presented to hf_moe."""
    COUNTS["hostile"] += n


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
