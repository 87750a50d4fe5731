"""Streaming conversion: checkpoint to checkpoint, tensor by tensor, the same files as the in-memory path."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_ids, tiny_dense
from safetensors.torch import load_file, save_file

from hf_moe import MoEForCausalLM, convert_checkpoint, convert_to_moe
from hf_moe.checkpoint import CheckpointError
from hf_moe.convert import stream
from hf_moe.convert.stream import StreamingUnsupported


def _files(directory):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    # (config.json differs: it records how each path checked its conversion, so its checksum differs too)
    index["metadata"]["checksums"].pop("config_files")
    return index, {f: load_file(directory / f) for f in sorted(set(index["weight_map"].values()))}


def _assert_same_checkpoint(a, b):
    index_a, files_a = _files(a)
    index_b, files_b = _files(b)
    assert index_a == index_b
    for name, tensors in files_a.items():
        assert tensors.keys() == files_b[name].keys()
        for key, tensor in tensors.items():
            other = files_b[name][key]
            assert tensor.dtype == other.dtype and torch.equal(tensor, other), key


@pytest.mark.parametrize(
    "model_type,num_experts,top_k,kwargs,tolerance",
    [
        ("llama", 4, 2, {}, 1e-5),
        ("phi3", 4, 2, dict(dtype="bfloat16"), 5e-2),
        ("gpt2", 4, 4, dict(method="split", partition="kmeans"), 1e-5),
        ("opt", 3, 3, dict(method="split", num_shared_experts=1, layers=[0, 2]), 1e-5),
        ("gemma", 4, 2, dict(num_shared_experts=1, reinit_fraction=0.5, every=2), None),  # redrawn: not exact
    ],
)
def test_streamed_checkpoint_equals_the_in_memory_one(model_type, num_experts, top_k, kwargs, tolerance, tmp_path):
    tiny_dense(model_type).save_pretrained(tmp_path / "dense", max_shard_size="40KB")  # several source shards
    moe = convert_checkpoint(tmp_path / "dense", tmp_path / "s", num_experts, top_k, progress=False, **kwargs)
    conv = moe.config.moe_conversion
    assert conv["max_abs_mlp_output"] > 1e-3  # the probe reaches the MLP: the difference is not vacuously small
    if tolerance is not None:
        assert conv["max_abs_block_diff"] < tolerance
    else:  # Drop-Upcycling redraws neurons: the check must see it
        assert conv["max_abs_block_diff"] > 0.1 * conv["max_abs_mlp_output"]
    convert_to_moe(tmp_path / "dense", num_experts, top_k, **kwargs).save_pretrained(tmp_path / "m")
    _assert_same_checkpoint(tmp_path / "s", tmp_path / "m")

    loaded = MoEForCausalLM.from_pretrained(tmp_path / "s")
    assert loaded.config.moe_layers == moe.config.moe_layers
    assert "streaming conversion" in (tmp_path / "s" / "README.md").read_text()


def test_streaming_is_exact_and_never_loads_the_model(tmp_path, monkeypatch):
    dense = tiny_dense("qwen2")
    dense.save_pretrained(tmp_path / "dense")

    def refuse(*args, **kwargs):
        raise AssertionError("streaming loaded a whole model or file")

    import safetensors.torch
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    convert_checkpoint(tmp_path / "dense", tmp_path / "moe", 4, 2, progress=False)
    monkeypatch.undo()

    moe = MoEForCausalLM.from_pretrained(tmp_path / "moe").eval()
    ids = random_ids()
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=0, atol=2e-5)


def test_checkpoint_saved_without_the_base_model_prefix(tmp_path):
    # Old GPT-2 checkpoints name their tensors `h.0.attn...`, not `transformer.h.0.attn...`.
    dense = tiny_dense("gpt2")
    dense.save_pretrained(tmp_path / "dense")
    tensors = load_file(tmp_path / "dense" / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()},
              tmp_path / "dense" / "model.safetensors", metadata={"format": "pt"})
    convert_checkpoint(tmp_path / "dense", tmp_path / "moe", 4, 2, progress=False)
    moe = MoEForCausalLM.from_pretrained(tmp_path / "moe").eval()
    ids = random_ids()
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=0, atol=2e-5)


def test_a_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    tiny_dense("llama").save_pretrained(tmp_path / "dense")
    calls = []

    def fail_on_the_third(self, key, tensor):
        calls.append(key)
        if len(calls) == 3:
            raise OSError("disk full")
        return original(self, key, tensor)

    original = stream._ShardWriter.write
    monkeypatch.setattr(stream._ShardWriter, "write", fail_on_the_third)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(tmp_path / "dense", tmp_path / "moe", 4, 2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]


def test_sources_that_cannot_be_streamed(tmp_path):
    dense = tiny_dense("llama")
    (tmp_path / "bin").mkdir()
    dense.config.save_pretrained(tmp_path / "bin")
    torch.save(dense.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(StreamingUnsupported, match="no safetensors"):
        convert_checkpoint(tmp_path / "bin", tmp_path / "o", 4, 2)
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(StreamingUnsupported, match="coactivation"):
        convert_checkpoint(tmp_path / "dense", tmp_path / "o", 4, 4, method="split", partition="coactivation",
                           calibration_data=str(tmp_path / "dense" / "config.json"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_checkpoint(tmp_path / "nowhere", tmp_path / "o", 4, 2)
    with pytest.raises(ValueError, match="top_k must be"):
        convert_checkpoint(tmp_path / "dense", tmp_path / "o", 4, 8)


def test_corrupt_or_missing_source_shards(tmp_path):
    tiny_dense("llama").save_pretrained(tmp_path / "dense", max_shard_size="40KB")
    shards = sorted((tmp_path / "dense").glob("model-*.safetensors"))
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shards[0].name} is corrupt"):
        convert_checkpoint(tmp_path / "dense", tmp_path / "o", 4, 2)
    shards[0].unlink()
    with pytest.raises(FileNotFoundError, match=f"lists {shards[0].name}, which is missing"):
        convert_checkpoint(tmp_path / "dense", tmp_path / "o", 4, 2)
    assert not (tmp_path / "o").exists()

