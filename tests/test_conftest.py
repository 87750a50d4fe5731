"""tests/conftest.py: the tiny MoE checkpoint is read-only, a change to it is caught, and each worker starts with its
share of the long files."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    DURATIONS,
    LONG_FILE_S,
    _fingerprint,
    assert_same_greedy,
    changes,
    copy_checkpoint,
    file_seconds,
    worker_shares,
)

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


def test_each_workers_share_starts_with_its_long_files():
    """Two workers: the shares have the sizes work stealing first gives them, the long files (>= LONG_FILE_S) are shared
    longest first to the share with the fewest seconds and lead it, each kept whole, and the short ones follow in
    collection order; every test is placed once."""
    files = {f"tests/test_{n}.py": [f"{n}{k}" for k in range(count)]
             for n, count in [("a", 3), ("long1", 2), ("b", 5), ("long2", 1), ("long3", 2), ("c", 4)]}
    seconds = {"tests/test_long1.py": 100.0, "tests/test_long2.py": 60.0, "tests/test_long3.py": 50.0,
               "tests/test_a.py": 5.0, "tests/test_b.py": LONG_FILE_S - 1}
    shares = worker_shares(files, seconds, 2)
    assert [len(share) for share in shares] == [8, 9]  # 17 tests: the first worker gets 17 // 2
    assert shares[0] == ["long10", "long11", "a0", "a1", "a2", "b0", "b1", "b2"]
    assert shares[1] == ["long20", "long30", "long31", "b3", "b4", "c0", "c1", "c2", "c3"]
    placed = sorted(test for share in shares for test in share)
    assert placed == sorted(test for tests in files.values() for test in tests)
    assert worker_shares(files, seconds, 1) == [["long10", "long11", "long20", "long30", "long31",
                                                 *files["tests/test_a.py"], *files["tests/test_b.py"],
                                                 *files["tests/test_c.py"]]]
    assert len(file_seconds(DURATIONS)) > 40  # the committed table parses


def test_the_durations_table_is_read_by_file(tmp_path):
    table = tmp_path / "durations.txt"
    table.write_text("# header\n## by file (2 files, 3 s in all)\n seconds tests  file\n"
                     "     2.5     3  tests/test_a.py\n     0.5     1  tests/test_b.py\n\n"
                     "   2.00    0.01    1.99     0.00  tests/test_a.py::test_x\n")
    assert file_seconds(table) == {"tests/test_a.py": 2.5, "tests/test_b.py": 0.5}
    assert file_seconds(tmp_path / "missing.txt") == {}


def test_greedy_outputs_may_part_only_at_a_near_tie():
    """assert_same_greedy: a row that parts from the reference passes only at a near tie of the reference's scores,
    and only with `near_tie`; the scores are compared up to that step, not after."""
    def output(tokens, scores):  # one row, a prompt of one token, one new token per step over a vocabulary of 3
        return SimpleNamespace(sequences=torch.tensor([[0, *tokens]]), scores=[torch.tensor([s]) for s in scores])

    reference = output([1, 2], [[0.0, 1.0, 0.99], [0.0, 0.0, 1.0]])
    near = output([2, 0], [[0.0, 1.0, 0.99], [5.0, 0.0, 0.0]])  # parts at a near tie; after it, anything
    assert_same_greedy(reference, reference, atol=0, rtol=0)
    assert_same_greedy(reference, near, atol=0, rtol=0, near_tie=0.02)
    with pytest.raises(AssertionError, match="parts from the reference at new token 0"):
        assert_same_greedy(reference, near, atol=0, rtol=0)
    tie = output([1, 2], [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    with pytest.raises(AssertionError, match="parts from the reference"):  # an exact tie, and no near_tie given
        assert_same_greedy(tie, output([2, 0], [[0.0, 1.0, 1.0], [5.0, 0.0, 0.0]]), atol=0, rtol=0)
    wide = output([2, 0], [[0.0, 1.0, 0.5], [5.0, 0.0, 0.0]])
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_same_greedy(output([1, 2], [[0.0, 1.0, 0.5], [0.0, 0.0, 1.0]]), wide, atol=0, rtol=0, near_tie=0.02)
    with pytest.raises(AssertionError):  # the same tokens, other scores
        assert_same_greedy(reference, output([1, 2], [[0.0, 1.0, 0.9], [0.0, 0.0, 1.0]]), atol=0, rtol=0)
