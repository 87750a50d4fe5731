"""int8 experts: their scales checked by every load and by verify, and written only when sound; group sizes
checked."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from hostile_support import (
    copy_of,
    edit_json,
    expert_file,
    hostile,
    leftovers,
    logits,
    record_checksums,
    refused,
    saved,  # noqa: F401 (fixture)
)

from hf_moe import MoEForCausalLM
from hf_moe.cli import main as cli


# -- int8 experts: their scales checked by every load and by verify, and written only when sound ---------------------
@pytest.fixture(scope="module")
def quantized(saved, tmp_path_factory):
    """The saved model with int8 experts (save_quantized, with a tokenizer), and its logits."""
    from conftest import tiny_tokenizer

    import hf_moe

    directory = tmp_path_factory.mktemp("int8") / "moe"
    model = hf_moe.quantize_experts(MoEForCausalLM.from_pretrained(saved[0]), "int8")
    hf_moe.save_quantized(model, directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory, logits(model)


def _set_scale(path: Path, value: float) -> str:
    """Set the first int8 scale of the file's first `_scale` tensor to `value` (F32, in place); returns its key."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    key, meta = next((k, m) for k, m in sorted(json.loads(raw[8 : 8 + n]).items()) if k.endswith("_scale"))
    struct.pack_into("<f", raw, 8 + n + meta["data_offsets"][0], value)
    path.write_bytes(raw)
    return key


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.5])
def test_int8_scales_that_are_nan_inf_or_negative_are_refused_everywhere(quantized, tmp_path, capsys, value):
    """load_quantized and `hf-moe generate` refused them; the offloaded loads ("disk" and "cpu") and `generate
    --offload-experts` ran them into non-finite logits, and verify said OK (the checksums recorded to match, as when
    save_quantized wrote them). Now every path refuses them, naming the file and the tensor."""
    import hf_moe

    directory = copy_of(quantized[0], tmp_path / "int8")
    path = expert_file(directory)
    key = _set_scale(path, value)
    record_checksums(directory, path)
    hostile()
    refused(lambda: hf_moe.load_quantized(directory), path.name)
    for mode in ("disk", "cpu"):
        refused(lambda: logits(MoEForCausalLM.from_pretrained(directory, offload_experts=mode,
                                                              max_expert_memory="1GB")), key)
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    assert key in capsys.readouterr().err
    assert cli(["generate", str(directory), "abc", "--max-new-tokens", "2", "--offload-experts", "disk",
                "--max-expert-memory", "1GB"]) == 2
    assert key in capsys.readouterr().err


def test_save_quantized_writes_no_non_finite_scales(saved, tmp_path):
    """Experts quantized from weights that are not finite (a diverged run) get NaN or inf scales: save_quantized wrote
    them. Now the save refuses, and nothing is written."""
    import hf_moe

    model = MoEForCausalLM.from_pretrained(saved[0])
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[2, 0, 0] = math.inf
    hf_moe.quantize_experts(model, "int8")
    hostile()
    refused(lambda: hf_moe.save_quantized(model, tmp_path / "int8"), "down_proj_scale", error=ValueError)
    refused(lambda: model.save_pretrained(tmp_path / "int8"), "down_proj_scale", error=ValueError)
    assert not (tmp_path / "int8").exists() and not leftovers(tmp_path / "int8")


def test_save_pretrained_of_an_int8_model_writes_what_load_quantized_reads(quantized, saved, tmp_path, capsys):
    """save_pretrained of an int8 model wrote the fused int8 buffers into the non-expert file: a checkpoint nothing
    loaded, which verify called OK. It writes what save_quantized writes now (one file per expert), bit for bit."""
    import hf_moe

    model = hf_moe.quantize_experts(MoEForCausalLM.from_pretrained(saved[0]), "int8")
    model.save_pretrained(tmp_path / "int8")
    for name in sorted(p.name for p in quantized[0].glob("*.safetensors")):
        assert load_file(tmp_path / "int8" / name).keys() == load_file(quantized[0] / name).keys(), name
        assert all(torch.equal(t, load_file(quantized[0] / name)[k]) for k, t in load_file(tmp_path / "int8" / name)
                   .items()), name
    assert torch.equal(logits(hf_moe.load_quantized(tmp_path / "int8")), quantized[1])
    capsys.readouterr()
    assert cli(["verify", str(tmp_path / "int8")]) == 0


@pytest.mark.parametrize("group_size", [0, -32, 48, "32"])
def test_a_bad_int8_group_size_is_named(saved, tmp_path, group_size):
    """group_size=0 escaped as a bare ZeroDivisionError (from quantize_experts, and from config.json at load)."""
    import hf_moe

    model = MoEForCausalLM.from_pretrained(saved[0])
    refused(lambda: hf_moe.quantize_experts(model, "int8", group_size=group_size), "group_size", error=ValueError)


def test_a_bad_int8_group_size_in_config_json_is_named(quantized, tmp_path):
    import hf_moe

    directory = copy_of(quantized[0], tmp_path / "int8")
    edit_json(directory / "config.json", lambda config: config["expert_quantization"].update(group_size=0))
    from hf_moe.checkpoint import record_config_files

    record_config_files(directory)
    hostile()
    refused(lambda: hf_moe.load_quantized(directory), "config.json", "group_size")
    refused(lambda: MoEForCausalLM.from_pretrained(directory, offload_experts="disk", max_expert_memory="1GB"),
            "config.json", "group_size")
