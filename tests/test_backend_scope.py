"""The backend choice has no hidden process-wide state: `use_backend` is scoped to the calling thread (or task), and a
changed HF_MOE_BACKEND is honoured by the next call, not ignored because an earlier call chose."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from hf_moe.ops import dispatch_ops, load_extension, use_backend
from hf_moe.ops.backend import forced_backend

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


@pytest.fixture
def compiled_available(monkeypatch):
    monkeypatch.setenv("HF_MOE_BACKEND", "auto")
    module, status = load_extension()
    if module is None:
        pytest.skip(f"the compiled extension is unavailable here ({status.how}): both choices would be torch")


def test_use_backend_in_one_thread_leaves_other_threads_alone(compiled_available):
    """A `with use_backend("torch")` in one thread (a server's request, a benchmark's worker) changed the ops every
    thread ran: the forced backend was one stack for the whole process."""
    assert dispatch_ops(CPU, "silu").name == "compiled"
    entered, done = threading.Event(), threading.Event()
    seen = {}

    def worker():
        with use_backend("torch"):
            seen["inside"] = dispatch_ops(CPU, "silu").name
            entered.set()
            done.wait(30)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert entered.wait(30)
        assert seen["inside"] == "torch"
        assert forced_backend() is None
        assert dispatch_ops(CPU, "silu").name == "compiled"  # this thread's choice, while the other's block is open
    finally:
        done.set()
        thread.join()
    with use_backend("torch"):  # the block still forces its own thread
        assert dispatch_ops(CPU, "silu").name == "torch"
    assert dispatch_ops(CPU, "silu").name == "compiled"


def test_a_changed_backend_setting_is_honoured(compiled_available, monkeypatch):
    """HF_MOE_BACKEND was read once, at the first call on a device, and a later value was silently ignored."""
    assert dispatch_ops(CPU, "silu").name == "compiled"
    monkeypatch.setenv("HF_MOE_BACKEND", "torch")
    assert dispatch_ops(CPU, "silu").name == "torch"
    assert load_extension()[0] is None and "HF_MOE_BACKEND=torch" in load_extension()[1].how
    monkeypatch.setenv("HF_MOE_BACKEND", "auto")
    assert dispatch_ops(CPU, "silu").name == "compiled"
    monkeypatch.setenv("HF_MOE_BACKEND", "fast")
    with pytest.raises(ValueError, match="HF_MOE_BACKEND must be auto, compiled, triton or torch"):
        dispatch_ops(CPU, "silu")


@pytest.mark.subprocess
def test_a_process_started_under_torch_loads_the_extension_when_the_setting_changes(compiled_available, fresh_python):
    """A process whose first call ran under HF_MOE_BACKEND=torch kept 'disabled' for good (the answer was cached)."""
    code = """
import os, torch
from hf_moe.ops import dispatch_ops, load_extension
cpu = torch.device("cpu")
print(dispatch_ops(cpu, "silu").name, load_extension()[1].how)
os.environ["HF_MOE_BACKEND"] = "auto"
print(dispatch_ops(cpu, "silu").name)
"""
    result = fresh_python.run(code, cwd=ROOT, timeout=600, set_env={"HF_MOE_BACKEND": "torch"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["torch disabled by HF_MOE_BACKEND=torch", "compiled"]
