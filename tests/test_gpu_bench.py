"""`scripts/gpu_bench.sh --smoke` (python -m hf_moe.gpu_check.bench): the second-light command a lent GPU runs, here on
CPU tensors under Triton's interpreter at tiny shapes, each step in a child process of its own: the layer table with
its absent competitors said so, the main job's Trainer runs, the per-expert checkpoint reloaded exactly, the report
and the tables for docs/backends.md. Also the arithmetic the GPU run depends on: how many layers fit, the FLOPs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from hf_moe.compat import triton_interpreter_problem
from hf_moe.gpu_check import bench, layer_bench, main_job

ROOT = Path(__file__).resolve().parents[1]
interpreter = pytest.mark.skipif(triton_interpreter_problem() is not None, reason=str(triton_interpreter_problem()))
# The correctness step is first light's (tests/test_gpu_check.py runs it under --smoke); the others are new here.
SMOKE_STEPS = "environment,layers,llama,qwen3,decode"


# The prepared command of the lent GPU, whose image has the oldest versions hf_moe supports: run on those versions
# alone (scripts/test_oldest.sh), not again on the main suite's, which the device does not run.
@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.gpu_versions
@interpreter
def test_gpu_bench_smoke_writes_its_report(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_MOE_BACKEND", "PYTHONPATH")}
    env.update(OUT=str(tmp_path), WHEELS=str(tmp_path / "no-wheels"))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), "--smoke", "--steps", SMOKE_STEPS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backends_table.md", "gpu_bench.log", "logs.txt",
                                                         "report.md", "results.json"]
    results = json.loads((tmp_path / "results.json").read_text())
    steps = {s["name"]: s for s in results["steps"]}
    assert [s["number"] for s in results["steps"]] == [1, 3, 4, 5, 6] and results["passed"]
    assert all(s["status"] == "passed" and 0 < s["seconds"] <= s["limit"] for s in results["steps"]), \
        [(s["name"], s["status"], s["summary"]) for s in results["steps"]]

    rows = steps["layer speed and memory"]["data"]["rows"]
    shapes = {r["shape"] for r in rows}
    assert len(shapes) == 2
    for shape in shapes:
        here = {r["impl"]: r for r in rows if r["shape"] == shape}
        assert {"hf_moe triton", "transformers grouped_mm", "dense"} <= set(here), here.keys()
        assert all(here[n]["status"] == "measured" for n in ("hf_moe triton", "transformers grouped_mm", "dense"))
        assert here["hf_moe triton"]["triton_ran"] and here["hf_moe triton"]["triton_launches"] > 0
        assert here["sonicmoe"]["status"].startswith("absent: ") and "74.4 MB" in here["sonicmoe"]["status"]
        assert here["liger fused MoE"]["status"].startswith(("absent: ", "measured"))
        assert here["transformers grouped_mm"]["rel_diff"] < 1e-4  # same weights, same routing, same layer (fp32)
        assert here["hf_moe triton"]["saved"] > 0 and here["hf_moe triton"]["saved_vs_dense"] > 0
        assert here["hf_moe triton"]["fwd_tflops"] > 0 and here["dense"]["fwd_vs_dense"] == 1.0

    llama = steps["main job: Llama dense and converted"]["data"]
    assert llama["layers"] == main_job.SMOKE_MAX_LAYERS and llama["sizing"]["capped"]
    assert [r["model"] for r in llama["results"]] == ["dense Llama", "Llama converted, 8 experts top-2"]
    assert all(len(r["losses"]) == main_job.SMOKE_WARMUP + main_job.SMOKE_STEPS for r in llama["results"])
    qwen3 = steps["main job: Qwen3-MoE"]["data"]
    assert [r["model"] for r in qwen3["results"]] == ["Qwen3-MoE hf_moe", "Qwen3-MoE grouped_mm",
                                                      "dense Qwen3 (intermediate 64)"]
    assert all(r["tokens_per_s"] > 0 and r["tflops"] > 0 for r in qwen3["results"])
    decode = steps["reload and decode"]["data"]
    assert decode["reload_logits_equal"] and len(decode["files"]) == 8 + 1  # one file per expert, one for the rest
    assert set(decode["results"]) == {"MoE (reloaded)", "dense"}

    table = (tmp_path / "backends_table.md").read_text()
    assert "### 3. layer speed and memory" in table and "| Qwen3-30B-A3B-like tiny |" in table
    assert "### 5. main job: Qwen3-MoE" in table
    assert "verdict: passed" in (tmp_path / "report.md").read_text()
    assert "no wheels installed" in (tmp_path / "gpu_bench.log").read_text()


def test_layers_that_fit_counts_parameters_and_refuses_with_the_sizes():
    """N from the parameters at 1 and 2 layers: 18 bytes a parameter, the activations per token, the logits."""
    def build(n):
        layers = torch.nn.ModuleList(torch.nn.Linear(100, 100, bias=False) for _ in range(n))
        return torch.nn.ModuleDict(dict(layers=layers, embed=torch.nn.Embedding(50, 100)))

    tokens, vocab, act = 10, 50, 1000
    layer = main_job.BYTES_PER_PARAM * 10_000 + tokens * act  # 190,000
    fixed = main_job.BYTES_PER_PARAM * 5_000 + main_job.LOGIT_BYTES * tokens * vocab  # 96,000
    free = int((fixed + 7.5 * layer) / main_job.MEMORY_SHARE)
    n, how = main_job.layers_that_fit(build, free, tokens, vocab, act)
    assert n == 7 and how["params_per_layer"] == 10_000 and how["params_rest"] == 5_000
    assert how["predicted_bytes"] == fixed + 7 * layer <= main_job.MEMORY_SHARE * free
    with pytest.raises(MemoryError, match=r"not one layer fits: .* GB usable .* a layer 0\.0 GB"):
        main_job.layers_that_fit(build, int(fixed / main_job.MEMORY_SHARE), tokens, vocab, act)


@pytest.mark.oldest
def test_the_real_shapes_fit_an_h200_with_room():
    """The sizing the GPU run will use, on the meta device: N for the two main-job models on 141 GB."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    from hf_moe.configuration import MoEConfig
    from hf_moe.modeling import MoEForCausalLM

    def llama_moe(n):
        with torch.device("meta"):
            base = LlamaConfig(num_hidden_layers=n, **main_job.SMOLLM2)
            return MoEForCausalLM(MoEConfig.from_base(base, num_experts=8, num_experts_per_tok=2))

    def qwen3(n):
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(Qwen3MoeConfig(num_hidden_layers=n, **main_job.QWEN3_30B))

    tokens, free = main_job.SEQ * main_job.BATCH, 140 * 10**9
    n_llama, how = main_job.layers_that_fit(llama_moe, free, tokens, 49152, main_job.act_per_token(2048, 8192, 2))
    assert 8 <= n_llama <= 16 and 400e6 < how["params_per_layer"] < 450e6  # 8 x 3 x 2048 x 8192 + attention
    n_qwen, how = main_job.layers_that_fit(qwen3, free, tokens, 151936, main_job.act_per_token(2048, 768, 8))
    assert 5 <= n_qwen <= 10 and 600e6 < how["params_per_layer"] < 650e6  # 128 x 3 x 2048 x 768 + attention
    dense = main_job.dense_qwen3_config(main_job.QWEN3_30B, n_qwen)
    assert (dense.intermediate_size, dense.num_hidden_layers, dense.num_key_value_heads) == (8 * 768, n_qwen, 4)


def test_flops_count_the_router_and_the_shared_experts():
    assert layer_bench.layer_flops(2048, 768, 128, 8, 0, 16384) == 16384 * (6 * 2048 * 768 * 8 + 2 * 2048 * 128)
    assert layer_bench.layer_flops(2048, 1408, 64, 6, 2, 1, router=False) == 6 * 2048 * 1408 * 8
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    # attention: q and o 64 x 64 each, k and v 64 x 32 each; 2 experts of 3 x 64 x 16; router 64 x 8; head 100 x 64
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 16 * 2 + 64 * 8
    want = 6.0 * (3 * per_layer + 100 * 64) + 12.0 * 3 * 4 * 16 * 32
    assert main_job.flops_per_token(config, 3, 16, 2, 32, router=8) == want


def test_learnable_ids_are_deterministic_and_follow_one_successor_table():
    a, b = main_job.learnable_ids(4, 50, 1000), main_job.learnable_ids(4, 50, 1000)
    assert torch.equal(a, b) and a.shape == (4, 50) and 0 <= int(a.min()) and int(a.max()) < 1000
    successors = {}
    for row in a.tolist():
        for x, y in zip(row, row[1:]):
            successors.setdefault(x, []).append(y)
    agree = sum(max(ys.count(y) for y in set(ys)) for ys in successors.values())
    assert agree >= 0.8 * sum(len(ys) for ys in successors.values())  # one in ten is drawn at random


def test_the_bench_refuses_a_budget_under_its_steps_minimum(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--budget", "30", "--out", os.devnull])
    assert "is under the" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--budget", "nan", "--out", os.devnull])
    assert "finite number of seconds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--steps", "layers,nope"])
    assert "unknown step(s) nope" in capsys.readouterr().err


def test_the_bench_reuses_first_lights_steps():
    targets = {s.key: s.target for s in bench.STEPS}
    assert targets["environment"] == "hf_moe.gpu_check.steps:step_environment"
    assert targets["correctness"] == "hf_moe.gpu_check.correctness:step_correctness"
    assert [s.key for s in bench.STEPS] == ["environment", "correctness", "layers", "llama", "qwen3", "decode"]
    assert sum(s.least for s in bench.STEPS) <= bench.BUDGET
