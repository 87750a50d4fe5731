"""Hostile paths: nothing outside the checkpoint is read (relative and absolute paths out, links out, a
streaming source's index), symlinks and loops inside OUT, and a source or export written over itself."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_dense
from transformers import AutoModelForCausalLM
from hostile_support import (
    copy_of,
    edit_json,
    expert_file,
    hostile,
    leftovers,
    logits,
    outside,  # noqa: F401 (fixture)
    refused,
    refused_under_verify,
    saved,  # noqa: F401 (fixture)
)

import hf_moe.checkpoint as checkpoint
from hf_moe import MoEForCausalLM, convert_checkpoint, convert_to_moe, export_native
from hf_moe.cli import main as cli


# -- Path traversal: nothing outside the checkpoint is read ----------------------------------------------------------
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
    (directory / "tokenizer.json").unlink()  # its own, in place of which a link leads out
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


# -- Symlinks and self-overwrite -------------------------------------------------------------------------------------
def test_out_as_a_symlink_updates_the_directory_it_names(saved, tmp_path):
    real = copy_of(saved[0], tmp_path / "real")
    os.symlink(real, tmp_path / "link")
    model = convert_to_moe(tiny_dense("llama", seed=1), num_experts=4, top_k=2)
    model.save_pretrained(tmp_path / "link")
    hostile()
    assert (tmp_path / "link").is_symlink() and os.readlink(tmp_path / "link") == str(real)
    assert torch.equal(logits(MoEForCausalLM.from_pretrained(real)), logits(model))
    assert leftovers(real) == []


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
    assert leftovers(out) == []


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
