"""benchmarks/quality.py: the smoke run (so the script cannot rot), its resume, and the parts with arithmetic in
them (FLOPs accounting, the upcycled optimizer state, the corpus checks)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_dense
from hf_moe import convert_to_moe
from hf_moe.ops import use_backend

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "quality.py"


def _quality():
    """benchmarks/quality.py as a module (benchmarks/ is not a package)."""
    if "quality_benchmark" not in sys.modules:
        spec = importlib.util.spec_from_file_location("quality_benchmark", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
        spec.loader.exec_module(module)
    return sys.modules["quality_benchmark"]


@pytest.mark.subprocess
@pytest.mark.slow
def test_smoke_run_writes_table_plot_and_claims_then_resumes(tmp_path):
    # The pure-torch ops: this tests the script, not the kernels (tests/test_ops.py does), and needs no C++ build.
    env = {**os.environ, "HF_MOE_BACKEND": "torch"}
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), "--cache-dir", str(_cache_dir())]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "corpus: " in first.stdout
    if "King James" not in first.stdout:  # PyPI out of reach: the fallback must say so
        assert "NOTE: using Python's bundled documentation" in first.stdout

    quality = _quality()
    report = (tmp_path / "quality.md").read_text()
    for name in [*quality.CONTESTANTS, quality.DENSE_HALF, quality.UPCYCLED]:
        assert f"| {name} |" in report, name
    assert "Seed claims at this scale:" in report and "not tested (one seed)" in report

    png = (tmp_path / "quality.png").read_bytes()
    assert png.startswith(b"\x89PNG") and 10_000 < len(png) < 200_000

    lines = (tmp_path / "quality_runs.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["settings"]["steps"] == quality.SMOKE.steps
    runs = [r for line in lines[1:] for r in json.loads(line)["runs"]]
    assert sorted(r["name"] for r in runs) == sorted([*quality.CONTESTANTS, quality.DENSE_HALF, quality.UPCYCLED])
    for r in runs:
        curve = r["curve"]
        assert all(math.isfinite(v) for v in curve["val_loss"]), r["name"]
        assert curve["step"][-1] == quality.SMOKE.steps and curve["val_loss"][-1] < curve["val_loss"][0], r["name"]
        assert curve["seconds"] == sorted(curve["seconds"]) and r["tokens_per_s"] > 0
    by_name = {r["name"]: r for r in runs}
    assert by_name["dense"]["load_cv"] is None and by_name["topk"]["load_cv"] > 0
    assert by_name["expert_choice"]["load_cv"] == 0.0
    upcycled = by_name[quality.UPCYCLED]
    assert upcycled["curve"]["step"][0] == quality.SMOKE.steps // 2
    assert upcycled["conversion_logit_diff"] < 1e-4  # the upcycled model starts as the dense checkpoint

    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming: 7 of 7 runs already done" in again.stdout
    assert " step " not in again.stdout  # nothing trained again
    assert (tmp_path / "quality.md").read_text() == report


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "hf_moe" / "quality"


def test_equal_active_flops_accounting():
    quality = _quality()
    s = quality.FULL
    dense = quality.forward_flops(s, "dense")
    assert dense["router"] == 0
    for name in quality.MOE:
        moe = quality.forward_flops(s, name)
        assert moe["total"] - moe["router"] == dense["total"], name
        assert 0 < moe["router"] < 0.01 * dense["total"], name
    upcycled = quality.forward_flops(s, quality.UPCYCLED)
    assert upcycled["mlp"] == 2 * dense["mlp"] and upcycled["attention"] == dense["attention"]
    # the built models have the sizes the accounting assumes
    dense_model, topk, switch = (quality.build_model(n, quality.SMOKE, 0) for n in ("dense", "topk", "switch"))
    s = quality.SMOKE
    assert dense_model.model.layers[0].mlp.up_proj.weight.shape == (s.top_k * s.expert_intermediate, s.hidden)
    assert topk.model.layers[0].mlp.experts.down_proj.shape == (s.experts, s.hidden, s.expert_intermediate)
    assert switch.model.layers[0].mlp.experts.down_proj.shape == (s.experts, s.hidden, 2 * s.expert_intermediate)
    assert switch.config.num_experts_per_tok == 1 and switch.config.capacity_factor == 1.25


def test_upcycled_optimizer_continues_the_dense_state():
    quality = _quality()
    dense = tiny_dense("llama").train()
    optimizer = quality.make_optimizer(dense, quality.SMOKE)
    ids = torch.randint(3, 100, (2, 8))
    for _ in range(2):
        dense(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = quality.named_optimizer_state(dense, optimizer)
    with use_backend("torch"):
        moe = convert_to_moe(dense, num_experts=4, top_k=2)
    moe_optimizer = quality.upcycled_optimizer(moe, state, quality.SMOKE)
    params = dict(moe.named_parameters())
    mlp = "model.layers.1.mlp."
    gate_up = moe_optimizer.state[params[mlp + "experts.gate_up_proj"]]["exp_avg"]
    expected = torch.cat([state[mlp + "gate_proj.weight"]["exp_avg"], state[mlp + "up_proj.weight"]["exp_avg"]])
    assert gate_up.shape[0] == 4 and all(torch.equal(gate_up[e], expected) for e in range(4))
    down = moe_optimizer.state[params[mlp + "experts.down_proj"]]["exp_avg_sq"]
    assert all(torch.equal(down[e], state[mlp + "down_proj.weight"]["exp_avg_sq"]) for e in range(4))
    attention = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(moe_optimizer.state[params[attention]]["exp_avg"], state[attention]["exp_avg"])
    assert params[mlp + "gate.weight"] not in moe_optimizer.state  # the routers start fresh
    with use_backend("torch"):  # the script's logic, not the kernels, is under test here
        moe(input_ids=ids, labels=ids).loss.backward()
    moe_optimizer.step()  # AdamW accepts the mixed state


def test_corpus_checks_name_the_problem(tmp_path):
    quality = _quality()
    (tmp_path / "kjv.jsonl").write_text('{"text": "In the beginning", "book": "Genesis", "chapter": 1}\n')
    with pytest.raises(quality.CorpusError, match="SHA-256 .* Delete it"):
        quality.fetch_corpus(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok", "book": "Genesis", "chapter": 1}\n{"text": 3}\n')
    with pytest.raises(quality.CorpusError, match="bad.jsonl:2"):
        quality.read_kjv(tmp_path / "bad.jsonl")
    (tmp_path / "short.jsonl").write_text('{"text": "ok", "book": "Genesis", "chapter": 1}\n')
    with pytest.raises(quality.CorpusError, match="1 verses, not the 31103"):
        quality.read_kjv(tmp_path / "short.jsonl")
