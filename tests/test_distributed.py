"""Multi-process training on CPU (gloo), launched with torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "tests" / "dist"


def torchrun(script: str, nproc: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run tests/dist/<script> under torchrun with `nproc` CPU processes; fail with its output if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(DIST / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def _passed(output: str, check: str) -> bool:
    """Whether rank 0 printed "OK ..." for `check`."""
    return any(line.startswith("OK") and check in line for line in output.splitlines())


def _assert_same_grads(a_path, b_path):
    a, b = torch.load(a_path), torch.load(b_path)
    assert a.keys() == b.keys() and any("mlp.gate.weight" in k for k in a)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.distributed
def test_aux_and_z_losses_are_not_overweighted_under_ddp(tmp_path):
    """transformers#48690: under average_tokens_across_devices Trainer multiplies the loss by the world size.
    Aux and z losses (coefficients 1.0 and 0.1, large enough to show a 2x error) must keep their weight:

    * identical rows: 2 DDP ranks give exactly the gradient of 1 process on one micro-batch;
    * different rows: 2 DDP ranks with a micro-batch each give the gradient of 1 process accumulating both.
    """
    torchrun("aux_loss_trainer.py", 2, str(tmp_path / "ddp_same.pt"), "1", "same")
    torchrun("aux_loss_trainer.py", 1, str(tmp_path / "one_same.pt"), "1", "same")
    _assert_same_grads(tmp_path / "ddp_same.pt", tmp_path / "one_same.pt")
    torchrun("aux_loss_trainer.py", 2, str(tmp_path / "ddp_mixed.pt"), "1", "mixed")
    torchrun("aux_loss_trainer.py", 1, str(tmp_path / "acc_mixed.pt"), "2", "mixed")
    _assert_same_grads(tmp_path / "ddp_mixed.pt", tmp_path / "acc_mixed.pt")


@pytest.mark.distributed
def test_expert_parallel_two_ranks(tmp_path):
    """EP=2: gradients equal single-process training on the union of the batches (mean of the losses), clipping
    uses the global norm, a rank whose experts get no tokens neither hangs nor breaks, E % P != 0 is an error,
    and a save under EP=2 reloads with EP=1 to equal logits."""
    out = torchrun("expert_parallel.py", 2, "core", str(tmp_path)).stdout
    for check in ("gradients equal single-process (world 2, EP 2)", "clip_grad_norm_ uses the global norm",
                  "a rank whose experts get no tokens", "num_experts not divisible", "reloaded with EP=1"):
        assert _passed(out, check), out[-2000:]
    # EP=2 x data-parallel 2 on four ranks; the EP=2 checkpoint loaded with EP=4, each rank reading its own expert.
    out = torchrun("expert_parallel.py", 4, "wide", str(tmp_path)).stdout
    for check in ("gradients equal single-process (world 4, EP 2)", "reloaded with EP=4"):
        assert _passed(out, check), out[-2000:]


@pytest.mark.distributed
def test_moe_trainer_under_expert_parallelism(tmp_path):
    """MoETrainer: non-expert parameters stay identical across ranks with max_grad_norm; checkpoints hold every
    rank's experts and optimizer state, and resuming continues exactly; the plain Trainer refuses EP models, and
    MoETrainer refuses TrainingArguments that see fewer processes than the model is sharded over."""
    out = torchrun("expert_parallel.py", 2, "trainer", str(tmp_path)).stdout
    for check in ("plain Trainer refuses", "non-expert parameters identical across ranks",
                  "checkpoint and resume under EP"):
        assert _passed(out, check), out[-2000:]
    out = torchrun("expert_parallel.py", 2, "misconfigured", str(tmp_path)).stdout
    assert _passed(out, "MoETrainer refuses TrainingArguments that do not see every process"), out[-2000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_accelerate_launch_example_with_expert_parallelism(tmp_path):
    """accelerate launch --multi_gpu --num_processes 2 (CPU, gloo) trains the example with --expert-parallel;
    its loss curve equals the 2-process run without expert parallelism and follows the single-process run."""
    import json

    from conftest import CORPUS, tiny_dense, tiny_tokenizer

    from hf_moe import convert_to_moe

    convert_to_moe(tiny_dense(), num_experts=4, top_k=2, noise=0.05).save_pretrained(tmp_path / "moe")
    tiny_tokenizer().save_pretrained(tmp_path / "moe")
    (tmp_path / "data.txt").write_text("\n".join([CORPUS] * 30))
    common = ["--model", str(tmp_path / "moe"), "--data", str(tmp_path / "data.txt"), "--max-steps", "8",
              "--block-size", "32", "--learning-rate", "3e-3", "--logging-steps", "1", "--sequential"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              str(ROOT / "examples" / "finetune_trainer.py")]
    runs = {
        "ep": launch + ["--expert-parallel", "--batch-size", "2"],
        "ddp": launch + ["--batch-size", "2"],
        "single": [sys.executable, str(ROOT / "examples" / "finetune_trainer.py"), "--batch-size", "4"],
    }
    curves = {}
    for name, cmd in runs.items():
        result = subprocess.run(cmd + common + ["--output-dir", str(tmp_path / name)], capture_output=True,
                                text=True, env=env, cwd=ROOT, timeout=600)
        assert result.returncode == 0, f"{name}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        assert f"; {1 if name == 'single' else 2} process(es)" in result.stdout  # the Trainer sees every process
        curves[name] = [loss for _, loss in json.loads((tmp_path / name / "loss_curve.json").read_text())]
    assert curves["ep"][-1] < curves["ep"][0]
    assert curves["ep"] == pytest.approx(curves["ddp"], rel=1e-4)
    # The two ranks' batches of 2 are the single process's batch of 4: the first loss (before any update) is the
    # same; after it, AdamW amplifies the different summation order only in the last digits.
    assert curves["ep"][0] == pytest.approx(curves["single"][0], rel=1e-5)
    assert curves["ep"] == pytest.approx(curves["single"], rel=1e-3)
