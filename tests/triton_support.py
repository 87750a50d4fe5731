"""What the Triton test files (tests/test_triton_*.py) share: where the kernels run, the launch table, the helpers.

How these files run. Triton binds a kernel to its compiler or to its interpreter when the kernel is defined, from
TRITON_INTERPRET. The suite runs without it and without a GPU, so the kernel tests cannot run in its process:
`test_kernels_under_the_interpreter` (tests/test_triton_backend.py) re-runs every tests/test_triton_*.py file in a
subprocess with TRITON_INTERPRET=1 and HF_MOE_BACKEND=triton, where they execute on CPU tensors (and the spawner
skips itself). On a GPU, without TRITON_INTERPRET, the kernel tests run directly on CUDA tensors (gpu_check runs the
tests marked `gpu`). The child records how often each kernel launched; the parent checks that every kernel did and
prints the table. Run the child's half alone with

    HF_MOE_BACKEND=triton TRITON_INTERPRET=1 python -m pytest tests/test_triton_*.py

Each file imports the two autouse fixtures below (`_launch_table`, `_no_fallback`).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRETING
KERNELS_RUN_HERE = INTERPRETING or ON_GPU
DEVICE = "cuda" if ON_GPU else "cpu"
LAUNCHES_FILE = "HF_MOE_TRITON_LAUNCHES"  # env: where the child writes its launch counts

kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="run by test_kernels_under_the_interpreter (TRITON_INTERPRET=1)")
parent_only = pytest.mark.skipif(INTERPRETING, reason="checked by the parent process, without the interpreter")
KERNEL_MODULES = ["routing", "permute", "activation", "grouped_gemm"]

if KERNELS_RUN_HERE:
    from hf_moe.ops.triton.ops import fell_back
    from hf_moe.ops.triton.runtime import launch_counts
    from test_ops import _routing

BF16 = dict(rtol=2e-2, atol=2e-2)
SMALL_GEMM = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)  # so small shapes span tiles, groups and K steps
SMALL_WEIGHT_GRAD = dict(BLOCK_P=16, BLOCK_Q=16, BLOCK_K=16)


def triton_test_files() -> list[Path]:
    """Every Triton test file: what the interpreter's child runs, and what gpu_check runs on a GPU."""
    return sorted(HERE.glob("test_triton_*.py"))


def _grads(fn, experts, x, weights):
    """(out, grad x, grad weights, {param: grad}) of `fn(x, weights)` under a fixed random output gradient."""
    x = x.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    experts.zero_grad()
    out = fn(x, weights)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out.backward(grad.to(device=out.device, dtype=out.dtype))
    return out.detach(), x.grad, weights.grad, {k: p.grad.clone() for k, p in experts.named_parameters()}


def _tol(dtype):
    return BF16 if dtype == torch.bfloat16 else {}


def _index(n, k, e, mode, seed=0):
    index, weights = _routing(n, k, e, mode, seed)
    return index.to(DEVICE), weights.to(DEVICE)


def all_kernel_names() -> set[str]:
    """Every `@triton.jit` kernel in hf_moe/ops/triton (functions named `_*_kernel`)."""
    names = set()
    for module in KERNEL_MODULES:
        mod = importlib.import_module(f"hf_moe.ops.triton.{module}")
        names |= {name for name, obj in vars(mod).items() if name.endswith("_kernel") and hasattr(obj, "fn")}
    return names


@pytest.fixture(scope="module", autouse=True)
def _launch_table(request):
    """After each module: write the process's launch counts so far (and the Triton ops that fell back to torch) where
    the parent (or gpu_check) asked, and print them. The counts add up over the modules a process runs, so the last
    module's write holds them all."""
    yield
    if not KERNELS_RUN_HERE:
        return
    counts = dict(launch_counts)
    if os.environ.get(LAUNCHES_FILE):  # one file per pytest-xdist worker (gpu_check sums them)
        worker = getattr(request.config, "workerinput", {}).get("workerid")  # this pytest's own worker id, if any
        path = Path(os.environ[LAUNCHES_FILE] + (f".{worker}" if worker else ""))
        path.write_text(json.dumps(dict(launches=counts, fell_back=dict(fell_back))))
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("\n" + _table(counts))


@pytest.fixture(autouse=True)
def _no_fallback():
    """A kernel test whose Triton op fell back to torch compared torch with torch: it fails, naming the op. (The test
    that forces a fallback does so on a dict of its own.)"""
    yield
    if KERNELS_RUN_HERE:
        assert not fell_back, f"Triton ops fell back to torch (the test compared torch with torch): {fell_back}"


def _table(counts: dict[str, int], where: str = "interpreter" if INTERPRETING else DEVICE) -> str:
    lines = [f"Triton kernel launches ({where}):"]
    lines += [f"  {name:<34} {n:>6}" for name, n in sorted(counts.items())]
    lines.append(f"  {'all ' + str(len(counts)) + ' kernels':<34} {sum(counts.values()):>6}")
    return "\n".join(lines)

