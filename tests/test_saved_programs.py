"""`import hf_moe` makes every hf_moe op resolvable: a `torch.export` program saved as .pt2 loads in a fresh process
after that import alone, and gives the outputs it gave when saved (hf_moe/ops/library.py)."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile

ROOT = Path(__file__).resolve().parents[1]

# Each saving process exports the tiny models it is given (WHICH DIR ...), each loading process loads the programs in
# the directories it is given: one process per backend each way, not one per program (a process start and `import
# hf_moe` cost more than an export).
_SAVE = textwrap.dedent(
    """
    import sys
    import torch

    sys.path.insert(0, "tests")
    from conftest import logits_of_a_tiny_moe

    for which, out in zip(sys.argv[1::2], sys.argv[2::2]):
        model = logits_of_a_tiny_moe(which)
        ids = torch.randint(3, 100, (2, 9))
        program = torch.export.export(model, (ids,))
        ops = sorted({str(n.target) for n in program.graph.nodes if "hf_moe" in str(n.target)})
        print(out, "ops:", ",".join(ops))
        torch.export.save(program, out + "/model.pt2")
        with torch.no_grad():  # the program's own outputs (eager inference may take another kernel: ops/infer.py)
            torch.save((ids, program.module()(ids)), out + "/io.pt")
    """
)

_LOAD = textwrap.dedent(
    """
    import sys
    import torch
    import hf_moe  # the only thing the saved programs need from hf_moe

    for out in sys.argv[1:]:
        program = torch.export.load(out + "/model.pt2")
        ids, want = torch.load(out + "/io.pt")
        with torch.no_grad():
            got = program.module()(ids)
        print(out, "equal:", torch.equal(got, want), "max diff:", (got - want).abs().max().item())
    """
)


def _run(fresh_python, code: str, *args: str, backend: str) -> subprocess.CompletedProcess:
    """`code` in a process that has not imported hf_moe, under HF_MOE_BACKEND=backend."""
    return fresh_python.run(code, *args, set_env={"HF_MOE_BACKEND": backend}, cwd=ROOT, timeout=900)


CASES = [
    ("converted", "auto", "hf_moe.moe_experts_forward.default"),  # the compiled CPU op
    pytest.param("converted", "torch", "hf_moe_torch.grouped_mm.default", marks=pytest.mark.oldest),
    ("native_mixtral", "auto", "hf_moe.moe_experts_forward.default"),
    ("quantized", "auto", "hf_moe.moe_experts_infer.default"),  # int8 experts: the inference op
]


@pytest.fixture(scope="module")
def saved_programs(fresh_python, request, tmp_path_factory) -> dict[tuple[str, str], dict[str, str]]:
    """{(which, backend): {"saved": the saving process's line, "loaded": the loading process's line under that
    backend, "pure": (backend auto) the line of a loading process under HF_MOE_BACKEND=torch}} for every case this
    session runs, each program saved in one process per backend and loaded in a fresh process per backend."""
    selected = {(item.callspec.params["which"], item.callspec.params["backend"]) for item in request.session.items
                if item.originalname == "test_saved_program_loads_in_a_fresh_process"}
    root = tmp_path_factory.mktemp("saved_programs")
    dirs = {case: root / "-".join(case) for case in selected}
    for path in dirs.values():
        path.mkdir()
    lines: dict[str, str] = {}

    def run(code, args, backend):
        done = _run(fresh_python, code, *args, backend=backend)
        assert done.returncode == 0, done.stderr[-4000:]
        for line in done.stdout.splitlines():
            key = line.split(" ", 1)[0]
            if key in args:
                lines[f"{key} {code is _SAVE} {backend}"] = line

    for backend in ("auto", "torch"):
        mine = [str(dirs[case]) for case in sorted(selected) if case[1] == backend]
        if mine:
            run(_SAVE, [a for case in sorted(selected) if case[1] == backend for a in (case[0], str(dirs[case]))],
                backend)
            run(_LOAD, mine, backend)
    if any(backend == "auto" for _, backend in selected):  # the compiled op's programs, where nothing is built
        run(_LOAD, [str(dirs[case]) for case in sorted(selected) if case[1] == "auto"], "torch")
    return {case: {"saved": lines.get(f"{path} True {case[1]}", ""),
                   "loaded": lines.get(f"{path} False {case[1]}", ""),
                   "pure": lines.get(f"{path} False torch", "")} for case, path in dirs.items()}


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("which,backend,op", CASES)
def test_saved_program_loads_in_a_fresh_process(which, backend, op, saved_programs):
    found = saved_programs[(which, backend)]
    assert op in found["saved"], found
    assert "equal: True" in found["loaded"], found
    if backend == "auto":  # the compiled op's program, in a process that builds nothing: its pure-torch kernel
        assert float(found["pure"].split("max diff:")[1]) < 1e-5, found


@pytest.mark.subprocess
@pytest.mark.oldest
def test_import_defines_every_op_without_building(fresh_python):
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
    done = _run(fresh_python, code, backend="torch")
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(done.stdout.splitlines()) == 12 + 2 + 9, done.stdout  # (CPU-only ops have no Triton twin)
