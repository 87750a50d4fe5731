"""Hostile inputs to shrink and to the commands that read a user's text files (calibration text, `hf-moe inspect
--routing --data`, merge recipes): files far larger than what is used are read in bounded memory and only as far as
needed, files parsed whole are refused above their limit before they are read, and checkpoints that shrink cannot
read as they are (adapter experts, tensors of the wrong size, non-finite weights) are refused with what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, VOCAB, tiny_dense, tiny_tokenizer
from hostile_support import hostile
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import hf_moe
from hf_moe import ShrinkError
from hf_moe.cli import main as cli
from hf_moe.inputs import MAX_JSON_BYTES, MAX_LINE_CHARS, PIECE_CHARS, size_text

ROOT = Path(__file__).resolve().parent.parent
GB = 1 << 30


@pytest.fixture
def moe_dir(tiny_moe):
    """The shared tiny hf_moe checkpoint (read-only) with its tokenizer: 4 experts, top-2."""
    return tiny_moe.path


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(CORPUS * 3)
    return path


def _mixtral(root: Path, name: str = "mixtral") -> Path:
    """A tiny native Mixtral checkpoint (4 experts, top-2, hidden 32, intermediate 24) with its tokenizer."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("mixtral", vocab_size=VOCAB, hidden_size=32, intermediate_size=24,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  num_local_experts=4, num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
    tiny_tokenizer().save_pretrained(root / name)
    return root / name


def _edit(directory: Path, key: str, edit) -> None:
    """Replace tensor `key` of a single-file checkpoint by `edit(tensor)`."""
    tensors = load_file(directory / "model.safetensors")
    tensors[key] = edit(tensors[key])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _sparse(path: Path, size: int, head: str = "") -> Path:
    """A file of `size` bytes that is `head` and then a hole (NUL bytes, no disk): written in a blink."""
    path.write_text(head)
    os.truncate(path, size)
    return path


# --------------------------------------------------------------------------------------------------------------
# Input files read in bounded memory, only as far as needed
# --------------------------------------------------------------------------------------------------------------
_CHILD = """
import json, resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from transformers import AutoTokenizer
from hf_moe import shrink
from hf_moe.convert.split import calibration_text
from hf_moe.inspect import routing_summary
moe, text, records, hole, out = sys.argv[2:]
found = {}
found["shrink"] = shrink(moe, out, 2, "frequency", text, progress=False).calibration_tokens
found["inspect"] = routing_summary(moe, text, max_tokens=512)[2]
found["split"] = calibration_text(records, AutoTokenizer.from_pretrained(moe), 2048).shape[1]
try:
    shrink(moe, out + "-hole", 2, "frequency", hole, progress=False)
except ValueError as err:
    found["hole"] = str(err)
found["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("FOUND " + json.dumps(found))
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_gigabyte_text_files_are_read_only_as_far_as_needed(moe_dir, tmp_path):
    """`shrink --data`, `inspect --routing --data` and a converter's calibration_data read a whole file and tokenized it
    as one string although they use a few thousand tokens, so memory grew with the file. Here each file is 1 GB
    (text at its start, then a sparse hole), read in a child process with a bounded address space: the text is read
    and tokenized piece by piece until enough tokens are there, and a file that is all hole is refused as binary."""
    head = "".join(f"line {i}: {CORPUS}\n" for i in range(600))  # ~130 KB: two pieces and more, 4096 tokens and more
    assert len(head) > 2 * PIECE_CHARS
    text = _sparse(tmp_path / "big.txt", GB, head)
    records = _sparse(tmp_path / "big.jsonl", GB, "".join(json.dumps({"text": CORPUS}) + "\n" for _ in range(100)))
    hole = _sparse(tmp_path / "hole.txt", GB)
    hostile(3)
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_MOE_BACKEND": "torch", "MALLOC_ARENA_MAX": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    limit = 3 * GB  # room for the child with the file unread, not for a 1 GB file read whole and tokenized
    done = subprocess.run([sys.executable, "-c", _CHILD, str(limit), str(moe_dir), str(text), str(records),
                           str(hole), str(tmp_path / "out")], capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("FOUND ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-3000:]
    found = json.loads(lines[-1][len("FOUND "):])
    assert found["shrink"] == 4096 and found["inspect"] == 512 and found["split"] == 2048
    assert "holds a NUL character (character 0): it is binary data, not text" in found["hole"]
    # The bound is the child's address space (`limit`): reading a file whole dies there (MemoryError). Its peak RSS
    # is printed, not asserted on: it varied with the load of the machine (docs/checkpoints.md).
    print(f"peak RSS {found['peak_rss'] / GB:.2f} GiB reading 1 GB files")
    assert not (tmp_path / "out-hole").exists()


def test_text_read_in_pieces_tokenizes_as_the_whole_text(calib, tmp_path):
    """Pieces are cut at line ends (or, in a line longer than a piece, anywhere): with the character-level tokenizer
    the ids are exactly those of the whole text, over several pieces, from .txt, .jsonl and .json alike."""
    from hf_moe.inputs import token_ids
    from hf_moe.shrink.calibration import calibration_ids

    tokenizer = tiny_tokenizer()
    line = "x" * (PIECE_CHARS + 100)  # no line end in a whole piece
    whole = f"{CORPUS}\n" * 400 + line + "\n" + CORPUS
    (tmp_path / "a.txt").write_text(whole)
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": whole}) + "\n" + json.dumps({"other": 1}) + "\n")
    (tmp_path / "a.json").write_text(json.dumps([{"text": whole}]))
    expected = tokenizer(whole)["input_ids"]
    for name in ("a.txt", "a.jsonl", "a.json"):
        assert token_ids(tmp_path / name, tokenizer, 10**9, "data") == expected, name
    ids = calibration_ids(tmp_path / "a.txt", tokenizer, 1000, 256, 256)
    assert ids.tolist() == torch.tensor(expected[:768]).view(3, 256).tolist()


def test_files_parsed_whole_are_refused_above_their_limit_before_they_are_read(moe_dir, tmp_path, capsys):
    """A .json calibration file, one .jsonl record and a YAML recipe are parsed whole: above their limit they are
    refused, naming it, without reading them (sparse files here, so nothing is written either)."""
    from hf_moe.convert.merge_config import MAX_RECIPE_BYTES, MergeConfigError, load_merge_config

    big_json = _sparse(tmp_path / "big.json", MAX_JSON_BYTES + 1)
    hostile(3)
    with pytest.raises(ShrinkError, match=rf"over the {size_text(MAX_JSON_BYTES)} limit.*give the text as \.jsonl"):
        hf_moe.shrink(moe_dir, tmp_path / "out", 2, "frequency", big_json, progress=False)
    long_line = _sparse(tmp_path / "long.jsonl", 2 * MAX_LINE_CHARS)
    with pytest.raises(ShrinkError, match=rf"line 1 is longer than the {size_text(MAX_LINE_CHARS)} characters"):
        hf_moe.shrink(moe_dir, tmp_path / "out", 2, "frequency", long_line, progress=False)
    recipe = _sparse(tmp_path / "merge.yml", 8 * MAX_RECIPE_BYTES, "base_model: x\n")
    with pytest.raises(MergeConfigError, match=rf"over the {size_text(MAX_RECIPE_BYTES)} limit.*calibration_data"):
        load_merge_config(recipe)
    assert cli(["merge", str(recipe), str(tmp_path / "merged")]) == 2
    assert f"over the {size_text(MAX_RECIPE_BYTES)} limit" in capsys.readouterr().err
    assert cli(["shrink", str(moe_dir), str(tmp_path / "out"), "--keep", "2", "--data", str(big_json)]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "merged").exists()


def test_the_token_counts_asked_for_are_checked(moe_dir, calib, tmp_path):
    from hf_moe.inspect import routing_summary

    hostile(5)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer, got 0"):
        routing_summary(moe_dir, calib, max_tokens=0)
    for name, value in (("calibration_tokens", 0), ("seq_len", 0), ("seq_len", 2.5), ("calibration_tokens", True)):
        with pytest.raises(ShrinkError, match=f"{name} must be a positive integer, got {value!r}"):
            hf_moe.shrink(moe_dir, tmp_path / "out", 2, "frequency", calib, progress=False, **{name: value})


# --------------------------------------------------------------------------------------------------------------
# Checkpoints shrink cannot read as they are
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "pesc"])
def test_adapter_expert_checkpoints_are_sent_to_materialize(tmp_path, calib, capsys, method):
    """Shrinking a lora or pesc checkpoint raised a bare KeyError: it reads plain experts, which `hf-moe materialize`
    makes from lora adapter experts (and from pesc ones nothing does: the message says so, and what to do)."""
    source = tmp_path / method
    hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method=method).save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    hostile()
    said = (f"run `hf-moe materialize {source} MATERIALIZED`" if method == "lora"
            else "`hf-moe materialize` makes from lora adapter experts only")
    for how in ("random", "frequency"):
        with pytest.raises(ShrinkError, match=f"holds {method} adapter experts") as caught:
            hf_moe.shrink(source, tmp_path / "out", 2, how, calib, progress=False)
        assert said in str(caught.value)
    assert cli(["shrink", str(source), str(tmp_path / "out"), "--keep", "2", "--data", str(calib)]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and "KeyError" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, tensor, shape", [
    ("model.layers.1.block_sparse_moe.experts.2.w1.weight", torch.zeros(20, 32), [24, 32]),
    ("model.layers.0.block_sparse_moe.experts.3.w2.weight", torch.zeros(32, 25), [32, 24]),
    ("model.layers.1.block_sparse_moe.gate.weight", torch.zeros(4, 31), [4, 32]),
    ("model.layers.0.block_sparse_moe.experts.0.w3.weight", torch.zeros(24, 32, dtype=torch.int32), [24, 32]),
])
def test_a_native_tensor_of_the_wrong_size_is_named_with_its_shape(tmp_path, calib, capsys, key, tensor, shape):
    """One expert tensor of another size gave `RuntimeError: stack expects each tensor to be equal size`."""
    source = _mixtral(tmp_path)
    _edit(source, key, lambda _: tensor)
    hostile()
    dtype = str(tensor.dtype).removeprefix("torch.")
    said = f"{key} is a {dtype} tensor of shape {list(tensor.shape)}, but config.json"
    for method in ("random", "frequency"):
        with pytest.raises(ShrinkError, match=r"implies a floating-point one of shape") as caught:
            hf_moe.shrink(source, tmp_path / "out", 2, method, calib, progress=False)
        assert said in str(caught.value) and f"of shape {shape}" in str(caught.value)
        assert "intermediate_size=24" in str(caught.value)
    assert cli(["shrink", str(source), str(tmp_path / "out"), "--keep", "2", "--data", str(calib)]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, value", [
    ("model.layers.0.block_sparse_moe.gate.weight", float("nan")),
    ("model.layers.1.block_sparse_moe.gate.weight", float("inf")),
    ("model.layers.1.block_sparse_moe.experts.2.w2.weight", float("nan")),
    ("model.layers.0.block_sparse_moe.experts.0.w1.weight", float("-inf")),
    ("model.layers.0.self_attn.q_proj.weight", float("nan")),  # copied as it is: read, so checked, too
])
def test_non_finite_native_weights_are_refused(tmp_path, calib, key, value):
    """A NaN router weight of a native checkpoint was shrunk silently: written with NaN, an arbitrary subset kept."""
    source = _mixtral(tmp_path)

    def poison(tensor):
        tensor = tensor.clone()
        tensor.view(-1)[7] = value
        return tensor

    _edit(source, key, poison)
    hostile()
    for method in ("random", "merge"):
        with pytest.raises(ShrinkError, match=rf"{key} holds 1 NaN or infinite value\(s\).*Shrink an earlier"):
            hf_moe.shrink(source, tmp_path / "out", 2, method, calib, progress=False)
    assert not (tmp_path / "out").exists()


def test_non_finite_experts_of_a_saved_hf_moe_model_are_refused(tmp_path, calib):
    """An hf_moe model saved after its training diverged (its checksums recorded over the infinity)."""
    model = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, noise=0.1)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[2, 0, 0] = float("inf")
    model.save_pretrained(tmp_path / "moe")
    tiny_tokenizer().save_pretrained(tmp_path / "moe")
    hostile()
    for method in ("random", "reconstruction"):
        with pytest.raises(ShrinkError, match=r"model.layers.1.mlp.experts.2.down_proj holds 1 NaN or infinite"):
            hf_moe.shrink(tmp_path / "moe", tmp_path / "out", 2, method, calib, progress=False)
    assert not (tmp_path / "out").exists()
