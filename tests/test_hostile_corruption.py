"""Silent corruption: flipped data bytes and changed headers are refused or named by verification (with a
seeded fuzz loop of byte flips in safetensors headers and data), and the offloaded path verifies what it
reads and notices expert files that change under it."""

from __future__ import annotations

import json
import math
import os
import random
import struct
from pathlib import Path

import pytest
import torch
from conftest import tiny_dense
from hostile_support import (
    copy_of,
    edit_header,
    edit_json,
    expert_file,
    hostile,
    logits,
    refused,
    refused_under_verify,
    saved,  # noqa: F401 (fixture)
    without_checksums,
)

import hf_moe.checkpoint as checkpoint
from hf_moe import CheckpointError, MoEForCausalLM, convert_to_moe
from hf_moe.cli import main as cli


# -- Silent corruption -----------------------------------------------------------------------------------------------
def test_flipped_data_bytes_are_named_by_verification(saved, tmp_path, capsys):
    """Same size, valid header, one byte of a tensor flipped: loads only without verification (with other logits);
    verification (the default, `verify_checksums=True`, `hf-moe verify`, export) names the file and the tensor."""
    directory, expected = saved
    assert cli(["verify", str(directory)]) == 0
    assert "every checksum (xxh3_128) matches" in capsys.readouterr().out
    directory = copy_of(directory, tmp_path / "moe")
    path, tensor = directory / "model-00001-of-00001.safetensors", "lm_head.weight"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n + json.loads(raw[8 : 8 + n])[tensor]["data_offsets"][0] + 3] ^= 0x40  # a float's exponent
    path.write_bytes(raw)
    loaded = MoEForCausalLM.from_pretrained(directory, verify_checksums=False)
    assert not torch.equal(logits(loaded), expected)  # what would otherwise load silently
    refused(lambda: MoEForCausalLM.from_pretrained(directory), path.name, tensor)
    refused_under_verify(directory, path.name, tensor)
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    err = capsys.readouterr().err
    assert f"{path.name}: tensor {tensor}: its bytes differ" in err and err.count("differ") == 1, err
    assert cli(["export", str(directory), str(tmp_path / "native")]) == 2
    assert path.name in capsys.readouterr().err and not (tmp_path / "native").exists()
    hostile()


@pytest.mark.parametrize("checksums", [True, False])
def test_dtype_changed_in_a_header_at_the_same_size(saved, tmp_path, checksums):
    """F32 -> I32 keeps every size: refused by the header checksum, or (a checkpoint without checksums) by the
    dtypes expected from the config."""
    directory = copy_of(saved[0], tmp_path / "moe")
    if not checksums:
        without_checksums(directory)
    path = expert_file(directory)
    edit_header(path, lambda header: header[sorted(k for k in header if k != "__metadata__")[0]].update(dtype="I32"))
    hostile()
    message = refused(lambda: MoEForCausalLM.from_pretrained(directory), path.name)  # (checked on every load)
    assert ("header" in message) if checksums else ("as I32" in message)
    refused_under_verify(directory, path.name)


def test_bf16_read_as_f16_and_a_transposed_shape_are_refused_by_the_config(tmp_path):
    """Without checksums, the config still fixes every dtype and shape: BF16 bytes declared F16, or a [32, 64]
    k_proj declared [64, 32], would load as garbage."""
    model = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "moe")
    without_checksums(tmp_path / "moe")
    shard = tmp_path / "moe" / "model-00001-of-00001.safetensors"
    original = shard.read_bytes()
    edit_header(shard, lambda h: h["model.layers.0.self_attn.o_proj.weight"].update(dtype="F16"))
    hostile(2)
    refused(lambda: MoEForCausalLM.from_pretrained(tmp_path / "moe"), shard.name, "as F16")
    shard.write_bytes(original)
    edit_header(shard, lambda h: h["model.layers.1.self_attn.k_proj.weight"].update(shape=[64, 32]))
    refused(lambda: MoEForCausalLM.from_pretrained(tmp_path / "moe"), shard.name, "k_proj", "[64, 32]")


def test_a_router_full_of_nan_is_refused(tmp_path, capsys):
    model = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.fill_(math.nan)
    model.save_pretrained(tmp_path / "moe")  # checksums match: the file is as saved, and still unusable
    hostile()
    shard = "model-00001-of-00001.safetensors"
    refused(lambda: MoEForCausalLM.from_pretrained(tmp_path / "moe"), shard, "layers.1.mlp.gate.weight", "NaN")
    refused_under_verify(tmp_path / "moe", shard)
    assert cli(["export", str(tmp_path / "moe"), str(tmp_path / "native")]) == 2
    assert "NaN" in capsys.readouterr().err and not (tmp_path / "native").exists()


def test_verification_needs_recorded_checksums(saved, tmp_path):
    directory = copy_of(saved[0], tmp_path / "moe")
    without_checksums(directory)
    hostile(2)
    MoEForCausalLM.from_pretrained(directory)  # the default verifies what is recorded
    refused(lambda: MoEForCausalLM.from_pretrained(directory, verify_checksums=True), "records no checksums")
    edit_json(directory / checkpoint.INDEX_NAME, lambda index: index["metadata"].update(
        checksums={"algorithm": "md5", "files": {}}))
    refused(lambda: MoEForCausalLM.from_pretrained(directory), checkpoint.INDEX_NAME, "md5")


def _flip(path: Path, region: str, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    at = rng.randrange(0, 8 + n) if region == "header" else rng.randrange(8 + n, len(data))
    for i in range(rng.choice((1, 1, 2, 4))):
        if at + i < len(data):
            data[at + i] ^= rng.randrange(1, 256)
    path.write_bytes(data)


@pytest.mark.slow
def test_fuzzed_headers_and_data(saved, tmp_path):
    """240 seeded mutations (1-4 bytes XOR-ed, half in a header, half in tensor data, in a random file). Without
    verification a header mutation is refused naming the file and a data mutation loads (or is refused naming the
    file: a router made NaN); with verification every one is refused naming the file."""
    directory = copy_of(saved[0], tmp_path / "moe")
    files = sorted(directory.glob("*.safetensors"))
    originals = {p: p.read_bytes() for p in files}
    rng = random.Random(10)
    outcomes = {"header refused": 0, "data loaded": 0, "data refused": 0}
    for i in range(240):
        path, region = rng.choice(files), ("header", "data")[i % 2]
        _flip(path, region, rng)
        hostile()
        try:
            MoEForCausalLM.from_pretrained(directory, verify_checksums=False)
        except CheckpointError as err:
            assert path.name in str(err), (i, region, str(err))
            outcomes[f"{region} refused"] += 1
        else:
            assert region == "data", f"mutation {i} of the header of {path.name} was accepted"
            outcomes["data loaded"] += 1
        refused_under_verify(directory, path.name)
        path.write_bytes(originals[path])
    assert outcomes["header refused"] == 120 and outcomes["data loaded"] > 60, outcomes


# -- The offloaded path verifies what it reads, and notices files that change under it -------------------------------
def _flip_every_tensor(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    for key, meta in json.loads(raw[8 : 8 + n]).items():
        if key != "__metadata__":
            raw[8 + n + meta["data_offsets"][0] + 3] ^= 0x40
    path.write_bytes(raw)


@pytest.mark.parametrize("mode", ["disk", "cpu"])
def test_offloaded_experts_are_verified(saved, tmp_path, capsys, mode):
    """One byte flipped in each tensor of an expert file: plain from_pretrained refused it, the offloaded loads ran
    the corrupted expert. Now each expert tensor is hashed at its first read ("cpu" reads them all at load)."""
    from conftest import tiny_tokenizer

    directory = copy_of(saved[0], tmp_path / "moe")
    path = expert_file(directory)
    _flip_every_tensor(path)
    hostile()

    def run():
        model = MoEForCausalLM.from_pretrained(directory, offload_experts=mode, max_expert_memory="1GB")
        logits(model)

    message = refused(run, path.name, "checksum")
    assert "model.layers." in message  # names the tensor
    refused(lambda: logits(MoEForCausalLM.from_pretrained(directory, offload_experts="disk", max_expert_memory="1GB",
                                                          verify_checksums=True)), path.name)
    if mode == "disk":
        tiny_tokenizer().save_pretrained(directory)
        capsys.readouterr()
        assert cli(["generate", str(directory), "abc", "--max-new-tokens", "4", "--offload-experts", "disk",
                    "--max-expert-memory", "1GB"]) == 2
        assert path.name in capsys.readouterr().err


@pytest.mark.parametrize("mtime", ["changed", "restored (cp -p)"])
def test_an_expert_file_overwritten_in_place_is_noticed(saved, tmp_path, mtime):
    """Offloaded generation read on after an expert file was overwritten in place (tokens changed, logits went
    non-finite, no error); with the modification time put back, as `cp -p` does, the size-and-mtime check let it
    through. Every read checks the file's size, modification time and inode change time against those at
    load. A save that replaces the directory (unlinking the old files: their change time moves too) is not a change."""
    directory = copy_of(saved[0], tmp_path / "moe")
    other = tmp_path / "other"
    convert_to_moe(tiny_dense("llama", seed=3), num_experts=4, top_k=2, noise=0.05).save_pretrained(other)
    model = MoEForCausalLM.from_pretrained(directory, offload_experts="disk", max_expert_memory="150KB")  # 2 experts
    assert torch.allclose(logits(model), saved[1], atol=1e-5)
    if mtime != "changed":  # a save into the directory meanwhile: the model reads on from the files it opened
        MoEForCausalLM.from_pretrained(other).save_pretrained(directory)
        assert torch.allclose(logits(model), saved[1], atol=1e-5)
        directory = copy_of(saved[0], tmp_path / "moe2")
        model = MoEForCausalLM.from_pretrained(directory, offload_experts="disk", max_expert_memory="150KB")
        assert torch.allclose(logits(model), saved[1], atol=1e-5)
    for e in range(4):  # another model's expert files, written over these in place (same size)
        path = expert_file(directory, e)
        before = os.stat(path)
        with open(path, "r+b") as f:
            f.write(expert_file(other, e).read_bytes())
        if mtime != "changed":
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    hostile()
    refused(lambda: logits(model), "changed on disk")
