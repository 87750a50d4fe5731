"""`python -m hf_moe.gpu_check --smoke`: every step of the GPU first-light check, on CPU tensors under Triton's
interpreter at tiny shapes, writing report.md and results.json; the steps that need a GPU say why they are
skipped. On a GPU the same command (without --smoke) is the real check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["environment", "tests/test_triton.py", "compute-sanitizer memcheck", "correctness at real shapes",
         "speed at 16k tokens, bf16", "training step, and EP x FSDP2"]


@pytest.mark.slow
def test_gpu_check_smoke_writes_its_report(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_MOE_BACKEND")}
    done = subprocess.run([sys.executable, "-m", "hf_moe.gpu_check", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    steps = {s["name"]: s for s in results["steps"]}
    assert [s["name"] for s in results["steps"]] == STEPS and results["passed"]
    status = {name: s["status"] for name, s in steps.items()}
    assert status == {**{name: "passed" for name in STEPS}, "compute-sanitizer memcheck": "skipped"}, status
    assert steps["compute-sanitizer memcheck"]["summary"].startswith("skipped: ")
    assert "TRITON_INTERPRET=1" in steps["tests/test_triton.py"]["data"]["where"]
    correctness = steps["correctness at real shapes"]["data"]
    assert len(correctness["cases"]) == 6 and correctness["large_tensor"]["status"] == "passed"
    assert not correctness["large_tensor"]["past_2_31"]  # tiny, and the report says so
    impls = {row["impl"] for row in steps["speed at 16k tokens, bf16"]["data"]["rows"]}
    assert impls == {"hf_moe triton", "hf_moe torch", "hf grouped_mm", "dense"}
    training = steps["training step, and EP x FSDP2"]["data"]
    assert training["expert_parallel"]["status"] == "skipped" and "2 or more CUDA devices" in \
        training["expert_parallel"]["summary"]
    report = (tmp_path / "report.md").read_text()
    positions = [report.index(f"## {i}. {name}") for i, name in enumerate(STEPS, 1)]
    assert positions == sorted(positions)
    assert "the same code at a tiny size" in report and "times mean nothing" in report
