"""ONNX: `torch.onnx.export(model, ..., dynamo=True)` of converted models and of native MoE models on
experts_implementation="hf_moe", on every CPU backend, and onnxruntime on CPU against PyTorch at two sequence lengths.

While torch.onnx.export traces, the experts run as standard ops (hf_moe/ops/dense.py: every expert on every token,
weighted by the routing), so the graph holds no hf_moe custom op and no stable sort (`aten.sort.stable`, which ONNX
has no translation for). A program exported first (`torch.export`, as transformers' ONNX exporter does) holds hf_moe
ops; torch.onnx.export decomposes them (hf_moe/ops/decompositions.py, tested op by op in test_decompositions.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _onnx_installed():
    """Skips the module without onnx, onnxscript or onnxruntime. Checked when the module's tests run, not when pytest
    collects it: importing onnxscript takes seconds, in every pytest process, the inner loop's included (which runs
    none of these tests)."""
    for name in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(name, reason=f"{name} is not installed (pip install -e '.[dev]')")


# Exports each WHICH model (WHICH PATH pairs) with HF_MOE_BACKEND as set, then runs it in onnxruntime at two sequence
# lengths (a dynamic sequence dimension) and prints the largest difference from PyTorch's logits and the graph's op
# domains, each line led by WHICH. One process per backend, both models in it (a process start costs about an export).
_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import onnxruntime as ort
    import torch

    sys.path.insert(0, "tests")
    from conftest import logits_of_a_tiny_moe

    for which, path in zip(sys.argv[1::2], sys.argv[2::2]):
        model = logits_of_a_tiny_moe(which)
        ids = torch.randint(3, 100, (1, 7))
        seq = torch.export.Dim("seq", min=2, max=64)
        program = torch.onnx.export(model, (ids,), dynamo=True, dynamic_shapes=({1: seq},), verbose=False)
        program.save(path)
        domains = sorted({node.domain or "ai.onnx" for node in program.model_proto.graph.node})
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        for length in (5, 11):
            ids = torch.randint(3, 100, (1, length))
            got = session.run(None, {session.get_inputs()[0].name: ids.numpy()})[0]
            with torch.no_grad():
                want = model(ids).numpy()
            print(f"{which} length {length}: max diff {np.abs(got - want).max():.3g}")
        print(f"{which} domains:", ",".join(domains))
    """
)


@pytest.fixture(scope="module")
def onnx_runs(request, tmp_path_factory, fresh_python) -> dict[tuple[str, str], list[str]]:
    """{(which, backend): the lines _SCRIPT printed for that model} for every case this session runs."""
    selected = {(item.callspec.params["which"], item.callspec.params["backend"]) for item in request.session.items
                if item.originalname == "test_onnx_export_runs_in_onnxruntime"}
    out = tmp_path_factory.mktemp("onnx")
    found = {}
    for backend in sorted({backend for _, backend in selected}):
        models = sorted(which for which, b in selected if b == backend)
        args = [a for which in models for a in (which, str(out / f"{which}-{backend}.onnx"))]
        done = fresh_python.run(_SCRIPT, *args, set_env={"HF_MOE_BACKEND": backend}, cwd=ROOT,
                                timeout=900)
        assert done.returncode == 0, done.stderr[-5000:]
        for which in models:
            found[(which, backend)] = [line.split(" ", 1)[1] for line in done.stdout.splitlines()
                                       if line.startswith(f"{which} ")]
    return found


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("which", ["converted", "native_mixtral"])
def test_onnx_export_runs_in_onnxruntime(which, backend, onnx_runs):
    lines = onnx_runs[(which, backend)]
    diffs = [float(line.split("max diff ")[1]) for line in lines if line.startswith("length ")]
    assert len(diffs) == 2 and max(diffs) < 1e-4, lines
    assert next(line for line in lines if line.startswith("domains:")) == "domains: ai.onnx", lines


def _onnxruntime_max_diff(path, model, lengths=(5, 11)) -> float:
    import numpy as np
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for length in lengths:
        ids = torch.randint(3, 100, (1, length))
        got = session.run(None, {session.get_inputs()[0].name: ids.numpy()})[0]
        with torch.no_grad():
            worst = max(worst, float(np.abs(got - model(ids).numpy()).max()))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("backend,which", [("compiled", "converted"), ("torch", "quantized")])
def test_exported_program_converts_to_onnx(backend, which, tmp_path):
    """torch.export first, then torch.onnx.export of the program, with a dynamic sequence length: onnxruntime matches
    PyTorch. The program holds hf_moe ops: the compiled backend's whole layer (moe_experts_forward, or
    moe_experts_infer where the CPU has its kernels), the torch backend's hf_moe_torch::grouped_mm and sort (and int8
    weights dequantized in the graph). On ffb5e1a: "No ONNX function found" for the hf_moe ops, and for
    aten.sort.stable."""
    import torch
    from conftest import logits_of_a_tiny_moe

    from hf_moe.ops import use_backend

    model = logits_of_a_tiny_moe(which)
    seq = torch.export.Dim("seq", min=2, max=64)
    with use_backend(backend), torch.no_grad():
        program = torch.export.export(model, (torch.randint(3, 100, (1, 7)),), dynamic_shapes=({1: seq},))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert any(t.startswith("hf_moe") for t in targets), targets  # what the conversion has to translate
    onnx_program = torch.onnx.export(program, verbose=False)
    onnx_program.save(tmp_path / "model.onnx")
    assert {node.domain or "ai.onnx" for node in onnx_program.model_proto.graph.node} == {"ai.onnx"}
    assert _onnxruntime_max_diff(tmp_path / "model.onnx", model) < 1e-4


@pytest.mark.slow
def test_transformers_onnx_exporter_on_hf_moe_experts(tmp_path):
    """transformers' own ONNX exporter (`transformers.exporters.OnnxExporter`: torch.export, then torch.onnx.export of
    the program) on Mixtral with experts_implementation="hf_moe", as its ONNX export tests run it: onnxruntime
    matches PyTorch (static shapes here, to keep CI short; test_exported_program_converts_to_onnx takes a dynamic
    length through the same conversion). On ffb5e1a: "No ONNX function found for hf_moe.moe_experts_infer"."""
    import torch

    exporters = pytest.importorskip("transformers.exporters", reason="transformers < 5.24 has no exporters")
    from conftest import logits_of_a_tiny_moe

    model = logits_of_a_tiny_moe("native_mixtral").model
    inputs = {"input_ids": torch.randint(3, 100, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    exported = exporters.OnnxExporter().export(model, inputs, config=exporters.OnnxConfig(dynamic=False))
    with torch.no_grad():
        want = model(**inputs).logits
    torch.testing.assert_close(torch.as_tensor(exported(**inputs).logits), want, rtol=1e-4, atol=1e-4)
