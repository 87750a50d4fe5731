"""A checkpoint named by its Hub id: resolved to its snapshot in a Hugging Face cache (laid out as
huggingface_hub writes it), then checked as any directory; int8 experts by Hub id."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import hub_cache
from transformers import AutoModelForCausalLM
from hostile_support import (
    copy_of,
    COUNTS,
    edit_json,
    expert_file,
    hostile,
    logits,
    outside,  # noqa: F401 (fixture)
    refused,
    saved,  # noqa: F401 (fixture)
)

from hf_moe import MoEForCausalLM
from hf_moe.cli import main as cli


# -- A checkpoint named by its Hub id: resolved to its snapshot in the cache, then checked as any directory ----------
@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline, which huggingface_hub (so `hf-moe`) uses by default."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_loads_from_its_cached_snapshot_after_the_checks(saved, hub, capsys):
    """The cache's layouts transformers reads: refs/main, another branch, a commit hash as revision, a subfolder,
    an explicit cache_dir; by from_pretrained, the Auto class, the offloaded load and every command."""
    from conftest import tiny_tokenizer

    source = copy_of(saved[0], hub.parent / "src")
    tiny_tokenizer().save_pretrained(source)
    snapshot = hub_cache(source, hub)
    hub_cache(source, hub, revision="dev")
    hub_cache(source, hub, repo="org/nested", subfolder="moe")
    model = MoEForCausalLM.from_pretrained("org/moe")
    assert torch.equal(logits(model), saved[1]) and model.config.name_or_path == "org/moe"
    for kwargs in ({"revision": "dev"}, {"revision": snapshot.name}, {"cache_dir": str(hub)}):
        assert torch.equal(logits(MoEForCausalLM.from_pretrained("org/moe", **kwargs)), saved[1]), kwargs
    assert torch.equal(logits(MoEForCausalLM.from_pretrained("org/nested", subfolder="moe")), saved[1])
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained("org/moe", cache_dir=str(hub))), saved[1])
    offloaded = MoEForCausalLM.from_pretrained("org/moe", offload_experts="disk", max_expert_memory="1GB")
    assert torch.allclose(logits(offloaded), saved[1], atol=1e-5)
    capsys.readouterr()
    assert cli(["verify", "org/moe"]) == 0
    assert cli(["inspect", "org/moe"]) == 0
    assert cli(["generate", "org/moe", "abc", "--max-new-tokens", "2"]) == 0
    COUNTS["hub"] += 10  # (refs/main, a branch, a commit, cache_dir, a subfolder, Auto, offloaded, 3 commands)
    assert "Traceback" not in capsys.readouterr().err
    assert cli(["verify", "--update", "org/moe"]) == 2  # (the cache is not the user's to edit)
    assert "Hugging Face cache" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="not a local directory, and the Hugging Face cache"):
        MoEForCausalLM.from_pretrained("org/absent")


def _blob(snapshot: Path, name: str) -> Path:
    return Path(os.path.realpath(snapshot / name))


def _flip_blob_byte(snapshot: Path) -> str:
    blob = _blob(snapshot, expert_file(snapshot).name)
    raw = bytearray(blob.read_bytes())
    raw[-5] ^= 0x10
    blob.write_bytes(raw)
    return expert_file(snapshot).name


def _edit_blob_config(snapshot: Path) -> str:
    edit_json(_blob(snapshot, "config.json"), lambda config: config.update(num_experts_per_tok=1))
    return "config.json"


def _ref_out_of_the_repository(snapshot: Path) -> str:
    """refs/main names `snapshots/../../outside`: a checkpoint in the cache's root, outside the repository."""
    (snapshot.parents[1] / "refs" / "main").write_text("../../outside")
    shutil.copytree(snapshot, snapshot.parents[2] / "outside")
    return "refs are damaged"


HUB_CASES = {"a flipped weight byte": _flip_blob_byte, "an edited config.json": _edit_blob_config,
             "a ref that leaves the repository": _ref_out_of_the_repository}


@pytest.mark.parametrize("case", sorted(HUB_CASES))
def test_a_hub_id_gets_every_check_a_directory_gets(saved, hub, capsys, case):
    """By Hub id, from_pretrained ran none of the checks (they ran `if os.path.isdir(...)`): a flipped weight byte
    loaded under verify_checksums=True, an edited config.json loaded. The id is resolved to its snapshot first; the
    same snapshot by path and by id are refused alike, by from_pretrained and by `hf-moe verify`."""
    snapshot = hub_cache(saved[0], hub)
    named = HUB_CASES[case](snapshot)
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained("org/moe", verify_checksums=True), named)
    refused(lambda: logits(MoEForCausalLM.from_pretrained("org/moe", offload_experts="disk",
                                                          max_expert_memory="1GB")), named)
    capsys.readouterr()
    assert cli(["verify", "org/moe"]) in (1, 2)  # 1: damaged; 2: the id names no checkpoint
    assert named in capsys.readouterr().err


def test_int8_experts_by_hub_id_are_refused_as_floats_and_load_with_load_quantized(saved, hub, tmp_path, capsys):
    """By Hub id, an int8 checkpoint loaded silently as a float model holding the raw int8 integers (logits off by
    0.81, another argmax), and load_quantized("org/name") answered "has no config.json"."""
    from conftest import tiny_tokenizer

    import hf_moe

    model = hf_moe.quantize_experts(MoEForCausalLM.from_pretrained(saved[0]), "int8")
    hf_moe.save_quantized(model, tmp_path / "int8")
    tiny_tokenizer().save_pretrained(tmp_path / "int8")
    hub_cache(tmp_path / "int8", hub, repo="org/int8")
    hostile()
    refused(lambda: MoEForCausalLM.from_pretrained("org/int8"), "load_quantized")
    assert torch.equal(logits(hf_moe.load_quantized("org/int8")), logits(model))
    capsys.readouterr()
    assert cli(["generate", "org/int8", "abc", "--max-new-tokens", "2"]) == 0
    assert cli(["verify", "org/int8"]) == 0
    COUNTS["hub"] += 3  # (load_quantized, generate, verify)
