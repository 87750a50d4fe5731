"""benchmarks/serve_cpu.py runs end to end at a tiny scale (`--smoke`: a tiny random MoE, its native export, eager
and compiled decoding in fp32, no llama.cpp; tests/test_decode.py compiles bf16) and prints its tables; its llama.cpp
pieces say why they are skipped; its page-cache re-read and huge-page count work on their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"


@pytest.mark.subprocess
@pytest.mark.slow
def test_serve_cpu_smoke_prints_every_table(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, str(BENCH / "serve_cpu.py"), "--smoke", "--workdir", str(tmp_path), "--precisions",
         "fp32", "--repeats", "1", "--out", str(tmp_path / "tables.md")],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    for name in ("hf_moe fp32 eager", "hf_moe fp32 compiled", "native fp32 eager", "native fp32 compiled"):
        assert f"| {name} |" in out, out
    assert "decode tok/s (median step)" in out and "prefill 16 tok/s" in out and "loss nats/byte" in out
    assert "on 2 MiB pages, MiB of RSS" in out
    assert "No llama.cpp contestant" in out
    assert (tmp_path / "tables.md").read_text().strip() == out.strip()
    results = json.loads((tmp_path / "serve_cpu_results.json").read_text())
    fp32 = results["hf_moe fp32 eager"]
    # The same model under hf_moe and under transformers' Mixtral: the same greedy tokens and loss; compiled too.
    for name in ("hf_moe fp32 compiled", "native fp32 eager", "native fp32 compiled"):
        assert results[name]["runs"][0]["tokens"] == fp32["runs"][0]["tokens"], name
    assert abs(results["native fp32 eager"]["loss"] - fp32["loss"]) < 1e-4
    assert 0 < fp32["loss"] < 10 and fp32["peak_rss"] > 0
    huge, rss = fp32["huge_pages"]
    assert 0 <= huge <= rss and rss > 0


def test_a_gguf_is_read_afresh_unchanged_and_a_process_s_huge_pages_are_counted(tmp_path):
    """`reread` (before llama.cpp maps a GGUF) drops the file from the page cache and reads it back, unchanged;
    `huge_page_bytes` reads a live process's smaps_rollup: what it maps with 2 MiB pages, at most its RSS."""
    sys.path.insert(0, str(BENCH))
    try:
        import serve_cpu
    finally:
        sys.path.remove(str(BENCH))
    path = tmp_path / "model.gguf"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    serve_cpu.reread(str(path))
    assert path.read_bytes() == data
    counted = serve_cpu.huge_page_bytes(os.getpid())
    if sys.platform.startswith("linux"):
        huge, rss = counted
        assert 0 <= huge <= rss and rss > 0
    assert serve_cpu.huge_page_bytes(2**22 + 7) is None  # no such process


def test_llamacpp_is_skipped_with_a_reason_without_node(tmp_path, monkeypatch):
    sys.path.insert(0, str(BENCH))
    try:
        import llamacpp
    finally:
        sys.path.remove(str(BENCH))
    monkeypatch.setenv("PATH", str(tmp_path))  # no `node` on it
    assert "Node.js is not installed" in llamacpp.installed(str(tmp_path))
    monkeypatch.undo()
    if llamacpp.node_missing() is None:
        assert "not installed in" in llamacpp.installed(str(tmp_path))  # Node, but no node-llama-cpp there


def test_the_former_fused_mode_names_still_work_and_warn():
    """The decode modes were "fused..." ("fused" is the word for stacked expert weights): --modes takes the old names
    for a release, each warning and run as the mode it is now; the names of now do not warn."""
    import warnings

    sys.path.insert(0, str(BENCH))
    try:
        import decode_modes
    finally:
        sys.path.remove(str(BENCH))
    with pytest.warns(DeprecationWarning) as caught:
        names = decode_modes.mode_names("eager,fused,fused_compiled,fused_python,fused_checked")
    assert len(caught) == 4 and "'fused_compiled' is now 'attention_block'" in str(caught[1].message)
    assert names == ["eager", "hf_moe_step", "attention_block", "attention_block_python", "attention_block_checked"]
    assert set(names[1:]) == decode_modes.HF_MOE_MODES and set(names[1:]) <= set(decode_modes.MODES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode_modes.mode_names("compiled,hf_moe_step") == ["compiled", "hf_moe_step"]
