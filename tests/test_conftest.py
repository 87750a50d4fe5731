"""The shared fixtures of tests/conftest.py: the tiny MoE checkpoint is read-only, and a change to it is caught."""

from __future__ import annotations

import os
import stat

import pytest
from conftest import _fingerprint, changes, copy_checkpoint

from hf_moe import MoEForCausalLM


def test_the_shared_checkpoint_is_read_only_on_disk(tiny_moe):
    paths = [tiny_moe.path, *tiny_moe.path.rglob("*")]
    assert len(paths) > 5 and (tiny_moe.path / "tokenizer.json").is_file()
    writable = [p.name for p in paths if p.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)]
    assert not writable, writable
    if os.geteuid() != 0:  # root writes whatever the permissions say: the fingerprint check below catches it
        with pytest.raises(PermissionError):
            (tiny_moe.path / "config.json").write_text("{}")


def test_a_change_to_a_checkpoint_is_named_and_a_copy_is_writable(tiny_moe, tmp_path):
    copy = copy_checkpoint(tiny_moe.path, tmp_path / "moe")
    before = _fingerprint(copy)
    assert before.keys() == _fingerprint(tiny_moe.path).keys()
    (copy / "config.json").write_text((copy / "config.json").read_text())  # same bytes, a new modification time
    (copy / "extra.txt").write_text("x")
    assert changes(before, _fingerprint(copy)) == ["config.json", "extra.txt"]
    model = MoEForCausalLM.from_pretrained(copy)  # the copy is a checkpoint like the original
    assert model.config.num_experts == 4
