"""A saved hf_moe checkpoint in a process that never imported hf_moe: its tokenizer loads with no question and no
warning, and its model says that it needs hf_moe. Checkpoints saved by older hf_moe (with `auto_map` and the shim
module) still load, with hf_moe imported and with trust_remote_code=True.

Each fresh process runs with stdin closed (transformers' question about custom code would then print and fail), and
those that load a tokenizer with warnings as errors.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import copy_checkpoint, random_ids, tiny_tokenizer

from hf_moe import MoEForCausalLM
from hf_moe.checkpoint import record_config_files
from hf_moe.checkpoint.format import AUTO_MAP, AUTO_MAP_MODULE, AUTO_MAP_SHIM

QUESTION = "Do you wish to run the custom code"


def _fresh(code: str, warnings: str = "error") -> subprocess.CompletedProcess:
    """`code` in a new Python process that must not import hf_moe; stdin closed, warnings are errors (by default)."""
    return subprocess.run(
        [sys.executable, "-W", warnings, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_tokenizer_loads_silently_and_the_model_names_hf_moe(tiny_moe):
    """AutoTokenizer.from_pretrained(dir) asked "Do you wish to run the custom code? [y/N]" (config.json's auto_map)
    and warned "You are using a model of type hf_moe to instantiate a model of type ``". Now it prints nothing and
    gives the tokenizer saved. The model, with or without trust_remote_code=True, is an error that names `hf_moe`."""
    path = str(tiny_moe.path)
    config = json.loads((tiny_moe.path / "config.json").read_text())
    assert "auto_map" not in config and not (tiny_moe.path / f"{AUTO_MAP_MODULE}.py").exists()
    assert "pip install hf-moe" in config["hf_moe_package"]["install"]
    result = _fresh(f"""
        import sys
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained({path!r})
        print("ids", tokenizer("the fox").input_ids)
        for kwargs in ({{}}, {{"trust_remote_code": True}}):
            try:
                AutoModelForCausalLM.from_pretrained({path!r}, **kwargs)
                raise SystemExit("the model loaded without hf_moe")
            except ValueError as err:
                print("error", kwargs, str(err).splitlines()[0])
        assert "hf_moe" not in sys.modules
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert QUESTION not in result.stdout and QUESTION not in result.stderr
    assert result.stderr.strip() == "", result.stderr[-3000:]  # (no warning, no progress bar)
    lines = result.stdout.splitlines()
    assert lines[0] == f"ids {tiny_tokenizer()('the fox').input_ids}"
    assert len(lines) == 3 and all(line.startswith("error") and "model type `hf_moe`" in line for line in lines[1:])


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_checkpoint_with_the_old_auto_map_still_loads(tiny_moe, tmp_path):
    """A checkpoint as older hf_moe saved it (`auto_map` in config.json, the shim module beside it): it loads with
    hf_moe imported, and with trust_remote_code=True in a process without it, with equal logits; a save there copies
    no hf_moe source (transformers marks classes loaded through auto_map). Its tokenizer still asks in such a process
    (the question is transformers', about that auto_map); saved again, it no longer does."""
    old = copy_checkpoint(tiny_moe.path, tmp_path / "old")
    config = json.loads((old / "config.json").read_text())
    config.pop("hf_moe_package")
    config["auto_map"] = AUTO_MAP
    (old / "config.json").write_text(json.dumps(config, indent=2))
    (old / f"{AUTO_MAP_MODULE}.py").write_text(AUTO_MAP_SHIM)
    record_config_files(old)
    ids = random_ids()
    model = MoEForCausalLM.from_pretrained(old).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny_moe.logits, rtol=0, atol=0)
    torch.save(ids, tmp_path / "ids.pt")
    result = _fresh(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(old)!r}, trust_remote_code=True).eval()
        assert "hf_moe" in sys.modules  # (the shim imported it)
        with torch.no_grad():
            torch.save(model(torch.load({str(tmp_path / 'ids.pt')!r})).logits, {str(tmp_path / 'logits.pt')!r})
        model.save_pretrained({str(tmp_path / 'again')!r})
    """, warnings="default")  # (the model's own deprecation warnings are not this test's)
    assert result.returncode == 0, result.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), tiny_moe.logits, rtol=0, atol=0)
    assert not list((tmp_path / "again").glob("*.py"))
    assert "auto_map" not in json.loads((tmp_path / "again" / "config.json").read_text())

    tokenizer = "from transformers import AutoTokenizer; AutoTokenizer.from_pretrained({!r})"
    assert QUESTION in _fresh(tokenizer.format(str(old))).stdout
    tiny_tokenizer().save_pretrained(tmp_path / "again")
    again = _fresh(tokenizer.format(str(tmp_path / "again")))
    assert again.returncode == 0 and QUESTION not in again.stdout and again.stderr.strip() == "", again.stderr[-3000:]
