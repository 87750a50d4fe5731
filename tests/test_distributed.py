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
