"""ONNX: `torch.onnx.export(model, ..., dynamo=True)` of converted models and of native MoE models on
experts_implementation="hf_moe", on every CPU backend, and onnxruntime on CPU against PyTorch at two sequence lengths.

While torch.onnx.export traces, the experts run as standard ops (hf_moe/ops/dense.py: every expert on every token,
weighted by the routing), so the graph holds no hf_moe custom op and no stable sort (`aten.sort.stable`, which the
torch backend's dispatch uses and ONNX has no translation for)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("onnx", reason="onnx is not installed (pip install -e '.[dev]')")
pytest.importorskip("onnxscript", reason="onnxscript is not installed (pip install -e '.[dev]')")
pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[1]

# Exports `which` model with HF_MOE_BACKEND as set, then runs it in onnxruntime at two sequence lengths (a dynamic
# sequence dimension) and prints the largest difference from PyTorch's logits and the graph's op domains.
_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import onnxruntime as ort
    import torch

    sys.path.insert(0, "tests")
    from conftest import logits_of_a_tiny_moe

    model = logits_of_a_tiny_moe(sys.argv[1])
    ids = torch.randint(3, 100, (1, 7))
    seq = torch.export.Dim("seq", min=2, max=64)
    program = torch.onnx.export(model, (ids,), dynamo=True, dynamic_shapes=({1: seq},), verbose=False)
    path = sys.argv[2]
    program.save(path)
    domains = sorted({node.domain or "ai.onnx" for node in program.model_proto.graph.node})
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for length in (5, 11):
        ids = torch.randint(3, 100, (1, length))
        got = session.run(None, {session.get_inputs()[0].name: ids.numpy()})[0]
        with torch.no_grad():
            want = model(ids).numpy()
        print(f"length {length}: max diff {np.abs(got - want).max():.3g}")
    print("domains:", ",".join(domains))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("which", ["converted", "native_mixtral"])
def test_onnx_export_runs_in_onnxruntime(which, backend, tmp_path):
    env = {**os.environ, "HF_MOE_BACKEND": backend}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, which, str(tmp_path / "model.onnx")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    lines = done.stdout.splitlines()
    diffs = [float(line.split("max diff ")[1]) for line in lines if line.startswith("length ")]
    assert len(diffs) == 2 and max(diffs) < 1e-4, done.stdout
    assert next(line for line in lines if line.startswith("domains:")) == "domains: ai.onnx", done.stdout
