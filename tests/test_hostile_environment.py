"""Hostile runs: generate under expert parallelism with prompts of unequal lengths, and a torch install
that changes under the extension's build cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch



ROOT = Path(__file__).resolve().parents[1]


# -- generate under expert parallelism with unequal lengths ----------------------------------------------------------
@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.slow
def test_generate_under_expert_parallelism_with_unequal_lengths(tmp_path):
    """Two gloo ranks generate 3 and 9 tokens from prompts of 4 and 9 tokens (greedy, then sampled): without
    synced_gpus the rank that is done leaves the other waiting in its next all_to_all forever."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "dist" / "ep_generate.py"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_MOE_BACKEND": "torch"}
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                               start_new_session=True)
    try:  # (each rank also ends itself after 180 s, printing where it hung)
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        process.terminate()  # torchrun stops its ranks on SIGTERM
        try:
            output, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output = ""
        pytest.fail(f"generate under expert parallelism hung (stopped after 240 s):\n{output[-3000:]}")
    assert process.returncode == 0, f"generate under expert parallelism failed or hung:\n{output[-4000:]}"
    assert "OK generate under EP=2" in output
    assert all((tmp_path / f"rank{r}.pt").is_file() for r in range(2))


# -- The extension's build cache is keyed on the torch install -------------------------------------------------------
def test_extension_cache_key_depends_on_the_torch_install(tmp_path):
    """Two environments with the same torch version (two venvs) get two cache entries, not one rebuilt in turn;
    rewriting torch's library in place changes the key too."""
    from hf_moe.ops.extension import source_hash

    installs = []
    for name in ("venv_a", "venv_b"):
        torch_dir = tmp_path / name / "torch"
        (torch_dir / "lib").mkdir(parents=True)
        (torch_dir / "lib" / "libtorch_cpu.so").write_bytes(b"same bytes")
        installs.append(torch_dir)
    keys = [source_hash(torch_dir=d) for d in installs]
    assert keys[0] != keys[1]
    os.utime(installs[0] / "lib" / "libtorch_cpu.so", ns=(1, 1))
    assert source_hash(torch_dir=installs[0]) != keys[0]
    assert source_hash() == source_hash(torch_dir=Path(torch.__file__).parent)
