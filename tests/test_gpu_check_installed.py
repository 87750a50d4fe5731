"""`python -m hf_moe.gpu_check` from an installed package, with no source tree beside it: the steps that need only
the package run, and the step that needs the source tree's Triton tests says so, and how to get a source checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hf_moe


@pytest.mark.subprocess
@pytest.mark.slow
def test_gpu_check_without_a_source_tree_says_how_to_get_one(tmp_path):
    """The package copied alone (as pip installs it into site-packages: no tests/, no pyproject.toml) into a
    directory run from; the Triton-tests step is skipped, naming the checkout and the command, and the run ends."""
    installed = tmp_path / "site-packages"
    shutil.copytree(Path(hf_moe.__file__).parent, installed / "hf_moe", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_MOE_BACKEND", "PYTHONPATH")}
    env["PYTHONPATH"] = str(installed)
    done = subprocess.run(
        [sys.executable, "-m", "hf_moe.gpu_check", "--smoke", "--steps", "triton-tests",
         "--out", str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert not (installed / "tests").exists()
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    (step,) = results["steps"]
    assert step["status"] == "skipped", step
    assert str(installed / "tests") in step["summary"]  # where it looked: beside the installed package
    for words in ("source tree", "source checkout", "clone the hf_moe repository", "pip install -e .[dev]",
                  "python -m hf_moe.gpu_check"):
        assert words in step["summary"], (words, step["summary"])
    assert step["summary"] in (tmp_path / "out" / "report.md").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
