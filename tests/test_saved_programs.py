"""`import hf_moe` makes every hf_moe op resolvable: a `torch.export` program saved as .pt2 loads in a fresh process
after that import alone, and gives the outputs it gave when saved (hf_moe/ops/library.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile

ROOT = Path(__file__).resolve().parents[1]

_SAVE = textwrap.dedent(
    """
    import sys
    import torch

    sys.path.insert(0, "tests")
    from conftest import logits_of_a_tiny_moe

    model = logits_of_a_tiny_moe(sys.argv[1])
    ids = torch.randint(3, 100, (2, 9))
    program = torch.export.export(model, (ids,))
    ops = sorted({str(n.target) for n in program.graph.nodes if "hf_moe" in str(n.target)})
    print("ops:", ",".join(ops))
    torch.export.save(program, sys.argv[2] + "/model.pt2")
    with torch.no_grad():  # the program's own outputs (eager inference may take another kernel: ops/infer.py)
        torch.save((ids, program.module()(ids)), sys.argv[2] + "/io.pt")
    """
)

_LOAD = textwrap.dedent(
    """
    import sys
    import torch
    import hf_moe  # the only thing the saved program needs from hf_moe

    program = torch.export.load(sys.argv[1] + "/model.pt2")
    ids, want = torch.load(sys.argv[1] + "/io.pt")
    with torch.no_grad():
        got = program.module()(ids)
    print("equal:", torch.equal(got, want), "max diff:", (got - want).abs().max().item())
    """
)


def _run(code: str, *args: str, backend: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_MOE_BACKEND": backend}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("which,backend,op", [
    ("converted", "auto", "hf_moe.moe_experts_forward.default"),  # the compiled CPU op
    pytest.param("converted", "torch", "hf_moe_torch.grouped_mm.default", marks=pytest.mark.oldest),
    ("native_mixtral", "auto", "hf_moe.moe_experts_forward.default"),
    ("quantized", "auto", "hf_moe.moe_experts_infer.default"),  # int8 experts: the inference op
])
def test_saved_program_loads_in_a_fresh_process(which, backend, op, tmp_path):
    saved = _run(_SAVE, which, str(tmp_path), backend=backend)
    assert saved.returncode == 0, saved.stderr[-4000:]
    assert op in saved.stdout, saved.stdout
    loaded = _run(_LOAD, str(tmp_path), backend=backend)
    assert loaded.returncode == 0, loaded.stderr[-4000:]
    assert "equal: True" in loaded.stdout, loaded.stdout
    if backend == "auto":  # the compiled op's program, in a process that builds nothing: its pure-torch kernel
        pure = _run(_LOAD, str(tmp_path), backend="torch")
        assert pure.returncode == 0, pure.stderr[-4000:]
        assert float(pure.stdout.split("max diff:")[1]) < 1e-5, pure.stdout


@pytest.mark.subprocess
@pytest.mark.oldest
def test_import_defines_every_op_without_building():
    """After `import hf_moe`, with HF_MOE_BACKEND=torch (nothing may be built), every op of the three namespaces
    resolves, with a schema; triton is not needed to define the Triton ones. (The inference op moe_experts_infer has
    no Triton twin, nor do the decode step's ops, linear_infer and decode_attention_block.)"""
    code = textwrap.dedent(
        """
        import torch
        import hf_moe
        from hf_moe.ops import decode, library

        names = [f"hf_moe::{name}" for name in library.SCHEMAS]
        names += [f"hf_moe_torch::{name}" for name in ("grouped_mm", "grouped_mm_weight_grad")]
        names += [f"hf_moe_triton::{name}" for name in library.SCHEMAS
                  if name != "moe_experts_infer" and name not in decode.SCHEMAS]
        for name in names:
            ns, op = name.split("::")
            print(name, getattr(getattr(torch.ops, ns), op).default._schema)
        """
    )
    done = _run(code, backend="torch")
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(done.stdout.splitlines()) == 12 + 2 + 9, done.stdout  # (CPU-only ops have no Triton twin)
