"""Writes: stale staging directories removed safely and none left by a failing writer, descriptors
bounded, the commit window (one swap, recovery after a kill between two renames), and streaming checks
what it copies against the config."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_dense
from hostile_support import (
    copy_of,
    edit_header,
    hostile,
    leftovers,
    logits,
    refused,
    saved,  # noqa: F401 (fixture)
)

import hf_moe.checkpoint.commit as commit
from hf_moe import MoEForCausalLM, convert_checkpoint, convert_to_moe
from hf_moe.cli import main as cli


# -- Staging: stale ones removed safely, none left by a failing writer, bounded descriptors --------------------------
@pytest.mark.subprocess
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
        assert leftovers(out) == sorted([live.name, lock.name])  # the live writer's staging and lock are kept
        assert (live / "config.json").is_file()
    finally:
        holder.kill()
        holder.wait()
    model.save_pretrained(out)
    assert leftovers(out) == []
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
    assert not (tmp_path / "failed").exists() and leftovers(tmp_path / "failed") == []
    assert sorted(os.listdir("/proc/self/fd")) == before


# -- The commit window -----------------------------------------------------------------------------------------------
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
    assert exchanges == [True] and out.stat().st_ino != before and leftovers(out) == []


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
    assert leftovers(out) == []


def test_without_rename_exchange_the_two_renames_still_commit(saved, tmp_path, monkeypatch):
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    out = copy_of(saved[0], tmp_path / "out")
    model = convert_to_moe(tiny_dense("llama", seed=2), num_experts=4, top_k=2)
    model.save_pretrained(out)
    assert torch.equal(logits(MoEForCausalLM.from_pretrained(out)), logits(model)) and leftovers(out) == []


# -- Streaming checks what it copies against the config --------------------------------------------------------------
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
