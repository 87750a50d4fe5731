"""Per-expert safetensors checkpoints: layout, dtype, atomic saves, and clear errors for broken directories."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import random_ids, tiny_dense
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hf_moe.checkpoint as checkpoint
import hf_moe.checkpoint.save as checkpoint_save
from hf_moe import CheckpointError, MoEForCausalLM, convert_to_moe
from hf_moe.inspect import format_summary, summarize_checkpoint

pytestmark = pytest.mark.oldest


@pytest.fixture
def moe():
    return convert_to_moe(tiny_dense("gpt2"), num_experts=4, top_k=2, layers=[0, 2])


@pytest.fixture
def saved(moe, tmp_path):
    moe.save_pretrained(tmp_path / "out")
    return tmp_path / "out"


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_one_file_per_expert_with_per_expert_keys(saved):
    files = sorted(p.name for p in saved.iterdir())
    assert files == [
        "README.md", "config.json", "generation_config.json", "model-00001-of-00001.safetensors",
        "model-expert-00000.safetensors", "model-expert-00001.safetensors", "model-expert-00002.safetensors",
        "model-expert-00003.safetensors", "model.safetensors.index.json",
    ]
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    with safe_open(saved / "model-expert-00002.safetensors", "pt") as f:
        keys = sorted(f.keys())
        assert f.get_tensor("transformer.h.0.mlp.experts.2.up_proj").shape == (256, 64)
    assert keys == sorted(
        f"transformer.h.{layer}.mlp.experts.2.{name}"
        for layer in (0, 2) for name in ("up_proj", "up_proj_bias", "down_proj", "down_proj_bias")
    )
    assert all(weight_map[k] == "model-expert-00002.safetensors" for k in keys)
    assert weight_map["transformer.h.0.mlp.gate.weight"] == "model-00001-of-00001.safetensors"
    assert "transformer.h.1.mlp.c_fc.weight" in weight_map  # layer 1 stays dense
    assert not any(k.endswith("experts.up_proj") for k in weight_map)  # no fused keys on disk
    assert index["metadata"]["total_size"] > 0


def test_reload_gives_identical_logits_with_both_entry_points(moe, saved):
    ids = random_ids()
    for loaded in (MoEForCausalLM.from_pretrained(saved), AutoModelForCausalLM.from_pretrained(saved)):
        assert isinstance(loaded, MoEForCausalLM)
        assert torch.equal(_logits(loaded.eval(), ids), _logits(moe.eval(), ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_is_preserved(tmp_path, dtype):
    moe = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, dtype=dtype)
    moe.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model-expert-00000.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.0.gate_up_proj").dtype == dtype
    loaded = MoEForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == dtype
    assert all(p.dtype == dtype for p in loaded.parameters())


def test_tied_embeddings_are_saved_once_and_stay_tied(tmp_path):
    moe = convert_to_moe(tiny_dense("llama", tie_word_embeddings=True), num_experts=4, top_k=2)
    moe.save_pretrained(tmp_path)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map
    loaded = MoEForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_large_experts_are_split_past_max_shard_size(moe, tmp_path):
    moe.save_pretrained(tmp_path, max_shard_size=70_000)  # one expert of one layer is ~132 KB
    names = sorted(p.name for p in tmp_path.glob("model-expert-00001*"))
    assert len(names) >= 2 and names[0] == f"model-expert-00001-00001-of-{len(names):05d}.safetensors"
    ids = random_ids()
    assert torch.equal(_logits(MoEForCausalLM.from_pretrained(tmp_path).eval(), ids), _logits(moe.eval(), ids))


def test_model_card_describes_the_model(saved):
    card = (saved / "README.md").read_text()
    for text in ("4 per MoE layer, top-2", "MoE layers | 2 of 3: 0, 2", "active per token", "`upcycle`",
                 "AutoModelForCausalLM.from_pretrained", "greedy tokens equal", "GPT2LMHeadModel"):
        assert text in card, text


def test_saving_over_an_existing_directory_keeps_unrelated_files(moe, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / "model-00001-of-00003.safetensors").write_text("stale")  # an older save's shard
    moe.save_pretrained(out)
    assert (out / "tokenizer.json").read_text() == "{}"
    assert not (out / "model-00001-of-00003.safetensors").exists()
    moe.save_pretrained(out)  # saving again replaces the previous save cleanly
    assert MoEForCausalLM.from_pretrained(out) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging leftovers


def test_a_users_readme_is_not_overwritten(moe, tmp_path):
    (tmp_path / "README.md").write_text("my notes")
    moe.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "my notes"


def test_interrupted_save_leaves_nothing_that_loads(moe, tmp_path, monkeypatch):
    calls = []

    def failing_save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated crash mid-save")
        return real(tensors, filename, metadata=metadata)

    real = checkpoint_save.save_file
    monkeypatch.setattr(checkpoint_save, "save_file", failing_save_file)
    with pytest.raises(KeyboardInterrupt):
        moe.save_pretrained(tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert list(tmp_path.iterdir()) == []  # the staging directory was removed too

    monkeypatch.setattr(checkpoint_save, "save_file", real)
    moe.save_pretrained(tmp_path / "old")
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "old").iterdir()}
    calls.clear()
    monkeypatch.setattr(checkpoint_save, "save_file", failing_save_file)
    with pytest.raises(KeyboardInterrupt):
        moe.save_pretrained(tmp_path / "old")
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "old").iterdir()} == before  # previous save intact
    MoEForCausalLM.from_pretrained(tmp_path / "old")


def test_not_main_process_writes_nothing(moe, tmp_path):
    moe.save_pretrained(tmp_path / "out", is_main_process=False)
    assert not (tmp_path / "out").exists()


# -- broken directories ------------------------------------------------------------------------------------------
def test_missing_directory():
    with pytest.raises(OSError):
        MoEForCausalLM.from_pretrained("/no/such/moe/dir")


def test_missing_expert_file_is_named(saved):
    os.remove(saved / "model-expert-00003.safetensors")
    with pytest.raises(CheckpointError, match=r"missing: model-expert-00003.safetensors"):
        MoEForCausalLM.from_pretrained(saved)
    with pytest.raises(CheckpointError, match="model-expert-00003"):
        AutoModelForCausalLM.from_pretrained(saved)


def test_truncated_file_is_named(saved):
    path = saved / "model-expert-00001.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model-expert-00001.safetensors is corrupt.*truncated"):
        MoEForCausalLM.from_pretrained(saved)


def test_garbage_file_is_named(saved):
    (saved / "model-00001-of-00001.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="model-00001-of-00001.safetensors is corrupt"):
        MoEForCausalLM.from_pretrained(saved)


def test_missing_expert_tensor_is_named(saved):
    index_path = saved / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["transformer.h.2.mlp.experts.1.down_proj"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"experts.1.down_proj.*model-expert-00001"):
        MoEForCausalLM.from_pretrained(saved)


def test_missing_non_expert_tensor_is_an_error(saved):
    from safetensors.torch import load_file, save_file

    shard = saved / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    del tensors["transformer.h.1.attn.c_attn.weight"]
    save_file(tensors, shard)
    index_path = saved / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["transformer.h.1.attn.c_attn.weight"]
    del index["metadata"]["checksums"]  # consistent edits of files and index, as another tool would make them
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor.*transformer.h.1.attn.c_attn.weight"):
        MoEForCausalLM.from_pretrained(saved)


def test_checkpoint_from_a_newer_version(saved):
    config = json.loads((saved / "config.json").read_text())
    config["hf_moe_format"] = 99
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="checkpoint format 99.*Upgrade hf_moe"):
        MoEForCausalLM.from_pretrained(saved)


def test_dense_checkpoint_is_pointed_to_conversion(tmp_path):
    tiny_dense().save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="dense `llama` model.*convert_to_moe"):
        MoEForCausalLM.from_pretrained(tmp_path)


# -- load into an existing model, file by file (Trainer resume) ----------------------------------------------------
def test_load_state_dict_takes_per_expert_keys_file_by_file(moe, saved):
    fresh = convert_to_moe(tiny_dense("gpt2", seed=5), num_experts=4, top_k=2, layers=[0, 2], seed=9)
    result = checkpoint.load_checkpoint(fresh, saved)
    assert result.missing_keys == [] and result.unexpected_keys == []
    ids = random_ids()
    assert torch.equal(_logits(fresh.eval(), ids), _logits(moe.eval(), ids))


def test_load_state_dict_with_a_full_per_expert_state_dict(moe):
    state = checkpoint.checkpoint_state_dict(moe)
    fresh = convert_to_moe(tiny_dense("gpt2", seed=5), num_experts=4, top_k=2, layers=[0, 2], seed=9)
    fresh.load_state_dict(state, strict=False)
    for name, param in moe.named_parameters():
        assert torch.equal(fresh.get_parameter(name), param), name


def test_inspect_summary(saved, moe):
    summary = summarize_checkpoint(saved)
    counts = moe.parameter_counts()
    assert summary.total_params == counts["total"]
    assert summary.active_params == counts["active"]
    text = format_summary(summary, saved)
    assert "MoE layers       2 of 3: 0, 2" in text
    assert "model-expert-00003.safetensors" in text and "expert 3 of every MoE layer" in text


# ------------------------------------------------------------------------------------------------------------------
# File modes, and `hf-moe verify --update`
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def umask():
    """Set the process's umask for the test (`umask(mask)`), restored after."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda mask: os.umask(mask)
    os.umask(old)


def _modes(directory) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in directory.iterdir() if p.is_file()}


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_every_saved_file_has_the_mode_the_umask_gives(moe, tmp_path, umask, mask):
    """safetensors 0.8 writes its files 0600, so save_pretrained, save_quantized and Trainer checkpoints were
    unreadable by other users while convert and merge wrote 0644. hf_moe's writers give every file the umask's mode."""
    import hf_moe

    umask(mask)
    moe.save_pretrained(tmp_path / "moe")
    hf_moe.save_quantized(hf_moe.quantize_experts(MoEForCausalLM.from_pretrained(tmp_path / "moe"), "int8"),
                          tmp_path / "int8")
    for directory in (tmp_path / "moe", tmp_path / "int8"):
        modes = _modes(directory)
        assert set(modes.values()) == {0o666 & ~mask}, modes
        assert any(name.endswith(".safetensors") for name in modes)


def _edit_config(directory) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["num_experts_per_tok"] = 1
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("mode", [0o644, 0o664])
def test_verify_update_keeps_the_index_mode(saved, mode, capsys):
    """`hf-moe verify --update` rewrote the index through mkstemp, 0600: every other user then got PermissionError."""
    from hf_moe.cli import main as cli

    index = saved / checkpoint.INDEX_NAME
    os.chmod(index, mode)
    _edit_config(saved)
    assert cli(["verify", "--update", str(saved)]) == 0
    assert index.stat().st_mode & 0o777 == mode
    assert MoEForCausalLM.from_pretrained(saved).config.num_experts_per_tok == 1


@pytest.mark.subprocess
def test_a_killed_verify_update_leaves_nothing_the_next_one_keeps(moe, saved):
    """A `verify --update` killed before its rename left `.model.safetensors.index.json.<random>` in the checkpoint,
    and the next --update left it there. It stages the index as a save stages a directory (a token and a lock,
    commit.py): the next --update removes what a killed one left, and a save does not carry it into the new model."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from hf_moe.cli import main as cli

    root = Path(__file__).resolve().parents[1]
    before = sorted(p.name for p in saved.iterdir())
    _edit_config(saved)
    code = ("import os, signal, sys; os.replace = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL); "
            "from hf_moe.checkpoint import record_config_files; record_config_files(sys.argv[1])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c", code, str(saved)], env=env, capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert sorted(p.name for p in saved.iterdir()) != before  # it did leave its staging
    with pytest.raises(CheckpointError, match="changed since the save"):  # (the old index: the edit is unrecorded)
        MoEForCausalLM.from_pretrained(saved)
    copy = shutil.copytree(saved, saved.parent / "copy", symlinks=True)
    assert cli(["verify", "--update", str(saved)]) == 0  # the next update
    assert sorted(p.name for p in saved.iterdir()) == before
    assert MoEForCausalLM.from_pretrained(saved).config.num_experts_per_tok == 1
    moe.save_pretrained(copy)  # the next save
    assert sorted(p.name for p in copy.iterdir()) == before
