"""Building and choosing the compiled (C++, CPU) extension: on first use, ahead of time, or not at all, with a clear
word about which backend runs; a failed build falls back to the pure-torch ops with one warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_moe.ops import backend_report, load_extension
from hf_moe.ops.extension import CPU_SOURCES, CSRC, source_hash

ROOT = Path(__file__).resolve().parents[1]

# A tiny MoE forward+backward in a fresh process; prints the backend that ran.
_RUN = """
import warnings, torch
warnings.simplefilter("always")
from hf_moe import MoEConfig, SparseMoeBlock
from hf_moe.ops import dispatch_ops
from transformers import LlamaConfig
config = MoEConfig.from_base(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2), num_experts=4, num_experts_per_tok=2)
block = SparseMoeBlock(config)
for _ in range(3):
    block(torch.randn(2, 5, 16, requires_grad=True)).sum().backward()
print("backend:", dispatch_ops(torch.device("cpu"), "silu").name)
"""


def _run(env: dict, code: str = _RUN) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env},
                          cwd=ROOT, timeout=600)


def test_compiled_backend_is_active_here():
    module, status = load_extension()
    assert module is not None, status.how
    assert backend_report()["experts (whole layer)"][0].startswith("compiled C++")


def test_backend_torch_skips_the_extension(tmp_path):
    result = _run({"HF_MOE_BACKEND": "torch", "HF_MOE_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "backend: torch" in result.stdout
    assert not any(tmp_path.iterdir())  # nothing was built
    env = _run({"HF_MOE_BACKEND": "torch"}, "import hf_moe.env as e; print(e.report())")
    assert "disabled by HF_MOE_BACKEND=torch" in env.stdout


def test_failed_build_falls_back_with_one_warning(tmp_path):
    if importlib_spec_exists("hf_moe._C"):
        pytest.skip("a prebuilt hf_moe._C is installed; the fallback is exercised without one")
    result = _run({"HF_MOE_CACHE": str(tmp_path), "CXX": "/bin/false", "CC": "/bin/false"})
    assert result.returncode == 0, result.stderr
    assert "backend: torch" in result.stdout
    assert result.stderr.count("could not be built") == 1, result.stderr
    forced = _run({"HF_MOE_CACHE": str(tmp_path / "2"), "CXX": "/bin/false", "HF_MOE_BACKEND": "compiled"})
    assert forced.returncode != 0 and "HF_MOE_BACKEND=compiled" in forced.stderr


def importlib_spec_exists(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_bad_backend_setting_is_an_error():
    result = _run({"HF_MOE_BACKEND": "fast"})
    assert result.returncode != 0 and "HF_MOE_BACKEND must be auto, compiled, triton or torch" in result.stderr


def test_source_hash_covers_the_sources():
    assert all((CSRC / s).is_file() for s in CPU_SOURCES)
    assert not (CSRC / "cuda").exists()  # CUDA runs the Triton kernels (tests/test_triton.py), not C++
    assert len(source_hash()) == 16


@pytest.mark.slow
def test_ahead_of_time_build_with_setup_py(tmp_path):
    """HF_MOE_BUILD_EXT=1 builds hf_moe._C, stamped with the hash of its sources, and its ops run."""
    env = {**os.environ, "HF_MOE_BUILD_EXT": "1"}
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (so,) = (tmp_path / "lib" / "hf_moe").glob("_C*.so")
    assert f"hf_moe_source_hash={source_hash()}".encode() in so.read_bytes()
    check = _run({}, f"""
import torch
import hf_moe.ops  # the ops' schemas (library.py); the library adds their CPU kernels
torch.ops.load_library({str(so)!r})
ids = torch.tensor([[2, 0], [1, 2]])
print(torch.ops.hf_moe.sort_by_expert(ids, 3)[2].tolist())
""")
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == "[1, 1, 2]"


def test_a_build_killed_midway_does_not_block_the_next_load(tmp_path):
    """torch's builder holds a `lock` file while it builds; a build killed midway left it, and every later process
    waited on it forever. Under hf_moe's own flock (released when a process dies) such a file is stale and goes."""
    import shutil

    from hf_moe.ops.extension import _cache_dir

    load_extension()  # the current build, to copy (so the test does not compile)
    built = _cache_dir() / source_hash()
    cache = tmp_path / "cache"
    shutil.copytree(built, cache / "ext" / built.name, ignore=shutil.ignore_patterns("lock", "*.lock"))
    (cache / "ext" / built.name / "lock").touch()  # as a killed build leaves it
    env = {**os.environ, "HF_MOE_CACHE": str(cache), "HF_MOE_BACKEND": "compiled"}
    result = subprocess.run(
        [sys.executable, "-c", "from hf_moe.ops import load_extension; print(load_extension()[1].how)"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "left by a build of the extension that was killed" in result.stderr
    assert not (cache / "ext" / built.name / "lock").exists()
