"""tests/conftest.py: the tiny MoE checkpoint is read-only, a change to it is caught, and the longest files run first."""

from __future__ import annotations

import itertools
import os
import stat

import pytest
from conftest import DURATIONS, _fingerprint, changes, copy_checkpoint, file_seconds

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


def test_the_files_that_take_longest_run_first_each_kept_together(pytestconfig, request):
    """The suite's own collection, as conftest orders it: files by the committed table's seconds, longest first; a
    file's tests together and in the order they are written."""
    seconds = file_seconds()
    assert len(seconds) > 40 and seconds == file_seconds(DURATIONS)
    order = [item.path.relative_to(pytestconfig.rootpath).as_posix() for item in request.session.items]
    files = list(dict.fromkeys(order))
    assert len(files) == len([name for name, _ in itertools.groupby(order)]), "a file's tests are split"
    times = [seconds.get(f, 0.0) for f in files]
    assert times == sorted(times, reverse=True), list(zip(files, times))


def test_the_durations_table_is_read_by_file(tmp_path):
    table = tmp_path / "durations.txt"
    table.write_text("# header\n## by file (2 files, 3 s in all)\n seconds tests  file\n"
                     "     2.5     3  tests/test_a.py\n     0.5     1  tests/test_b.py\n\n"
                     "   2.00    0.01    1.99     0.00  tests/test_a.py::test_x\n")
    assert file_seconds(table) == {"tests/test_a.py": 2.5, "tests/test_b.py": 0.5}
    assert file_seconds(tmp_path / "missing.txt") == {}
