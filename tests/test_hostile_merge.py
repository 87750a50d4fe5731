"""Merge recipes (non-finite scales, alias bombs, deep nesting, bad dtypes, empty calibration text) and
conversions that cannot fit (2**40 experts, more than the free disk or memory): refused at once, with the
numbers."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_dense
from hostile_support import (
    copy_of,
    COUNTS,
    expert_file,
    hostile,
    leftovers,
    record_checksums,
    refused,
    saved,  # noqa: F401 (fixture)
)

import hf_moe.checkpoint as checkpoint
from hf_moe import MoEForCausalLM, convert_checkpoint, convert_to_moe
from hf_moe.cli import main as cli


ROOT = Path(__file__).resolve().parents[1]


# -- Merge recipes: non-finite scales, alias bombs, deep nesting, bad dtypes, empty calibration text -----------------
@pytest.fixture(scope="module")
def dense_sources(tmp_path_factory):
    """A tiny base Llama and two 'fine-tunes' of it (other seeds), each with a tokenizer."""
    from conftest import tiny_tokenizer

    root = tmp_path_factory.mktemp("dense")
    paths = []
    for seed in range(3):
        tiny_dense("llama", seed=seed).save_pretrained(root / f"m{seed}")
        tiny_tokenizer().save_pretrained(root / f"m{seed}")
        paths.append(str(root / f"m{seed}"))
    return paths


def _merge_yaml(path: Path, sources: list[str], first: str = "", top: str = "", gate_mode: str = "random",
                dtype: str = "float32", second: str = "") -> Path:
    """A mergekit-moe recipe over `sources` (base, then two experts): `first` and `second` are more lines of each
    expert's mapping, `top` more top-level lines."""
    path.write_text(f"base_model: {sources[0]}\ngate_mode: {gate_mode}\ndtype: {dtype}\n{top}experts:\n"
                    f"  - source_model: {sources[1]}\n{first}  - source_model: {sources[2]}\n{second}")
    return path


def _alias_bomb(levels: int) -> str:
    """A flow list whose last item expands to 9**levels strings, in a few hundred bytes of YAML."""
    items = ["&a0 [" + ", ".join(["lol"] * 9) + "]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


_PROMPTS = ("    positive_prompts: [the quick brown fox]\n", "    positive_prompts: [a mixture of experts]\n")
# case -> (_merge_yaml's keyword arguments, the field the error names)
MERGE_CASES = {
    "residual_scale .nan": (dict(first="    residual_scale: .nan\n"), "residual_scale"),
    "noise_scale .inf": (dict(first="    noise_scale: .inf\n"), "noise_scale"),
    "residual_scale 1e300": (dict(first="    residual_scale: 1.0e+300\n"), "residual_scale"),
    "an alias bomb in a field": (dict(first=f"    positive_prompts: {_alias_bomb(8)}\n"), "positive_prompts"),
    "a list nested 3000 deep": (dict(top="layers: " + "[" * 3000 + "]" * 3000 + "\n"), "nests"),
    "hidden_dtype: banana": (dict(top="hidden_dtype: banana\n", gate_mode="hidden", first=_PROMPTS[0],
                                  second=_PROMPTS[1]), "hidden_dtype"),
    "dtype: int8": (dict(dtype="int8"), "dtype"),
    "seed: 2**70": (dict(top=f"seed: {2**70}\n"), "seed"),
}


@pytest.mark.parametrize("case", sorted(MERGE_CASES))
def test_hostile_merge_recipes_are_refused_at_once(dense_sources, tmp_path, capsys, case):
    """`hf-moe merge` wrote NaN/inf experts for residual_scale .nan, noise_scale .inf or 1e300 (and its parity line said
    0.00e+00); a YAML alias bomb of a few hundred bytes expanded in a message's repr until a MemoryError; a deep list, a
    dtype named banana (or int8) and a seed past 2**64 ended in tracebacks or torch's "Overflow when unpacking long
    long". Each is refused at once, naming the field, and nothing is written."""
    import time

    kwargs, named = MERGE_CASES[case]
    recipe = _merge_yaml(tmp_path / "merge.yml", dense_sources, **kwargs)
    hostile()
    capsys.readouterr()
    start = time.perf_counter()
    assert cli(["merge", str(recipe), str(tmp_path / "out")]) == 2
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err and len(err) < 3000, err[-3000:]
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path / "out")


@pytest.mark.parametrize("scale", ["noise_scale: 1.0e+19", "residual_scale: 1.0e+300"])
def test_a_merged_expert_that_overflows_is_refused_not_reported_as_exact(dense_sources, tmp_path, capsys,
                                                                         monkeypatch, scale):
    """Past the recipe's bounds (lifted here): noise of 1e19 gives finite weights whose outputs overflow, and the parity
    check (max(0.0, nan) is 0.0) printed "reproduces its source model's MLP within 0.00e+00"; a residual_scale of 1e300
    gives infinite weights, which were written. Each expert is checked as written, and nothing is."""
    import hf_moe.convert.merge_config as merge_config

    monkeypatch.setattr(merge_config, "MAX_SCALE", math.inf, raising=False)
    recipe = _merge_yaml(tmp_path / "merge.yml", dense_sources, f"    {scale}\n")
    hostile()
    capsys.readouterr()
    assert cli(["merge", str(recipe), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "experts[0]" in err and "layer 0" in err and scale.split(":")[0] in err, err[-2000:]
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path / "out")


@pytest.mark.parametrize("value", [math.nan, -math.inf])
def test_verify_names_an_expert_that_holds_nan_saved_with_matching_checksums(saved, tmp_path, capsys, value):
    """A checkpoint saved with non-finite experts (a bad merge or a diverged run: its checksums match) loaded and
    computed NaN, and `hf-moe verify` said OK. Verify counts every floating tensor's NaN and infinite values in its
    pass over the bytes, and names each tensor that holds any."""
    directory = copy_of(saved[0], tmp_path / "moe")
    path = expert_file(directory, 2)
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    key, meta = next((k, m) for k, m in sorted(json.loads(raw[8 : 8 + n]).items()) if k.endswith("down_proj"))
    struct.pack_into("<f", raw, 8 + n + meta["data_offsets"][0] + 4 * 7, value)
    path.write_bytes(raw)
    record_checksums(directory, path)
    hostile()
    capsys.readouterr()
    assert cli(["verify", str(directory)]) == 1
    err = capsys.readouterr().err
    assert f"{path.name}: tensor '{key}' holds 1 NaN or infinite value(s)" in err, err


def test_a_source_mlp_that_holds_nan_is_named(dense_sources, tmp_path, capsys):
    """A source whose MLP holds NaN was refused as "could not reproduce its output (max abs difference nan)": as if
    its forward were unusual. The merge now says what is wrong, naming the source and the layer."""
    from transformers import AutoModelForCausalLM as Dense

    broken = tmp_path / "broken"
    model = Dense.from_pretrained(dense_sources[1])
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = math.nan
    model.save_pretrained(broken)
    shutil.copy(Path(dense_sources[1]) / "tokenizer.json", broken)
    shutil.copy(Path(dense_sources[1]) / "tokenizer_config.json", broken)
    recipe = _merge_yaml(tmp_path / "merge.yml", [dense_sources[0], str(broken), dense_sources[2]])
    hostile()
    capsys.readouterr()
    assert cli(["merge", str(recipe), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{broken}, layer 1" in err and "NaN" in err, err[-2000:]
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path / "out")


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_empty_calibration_text_is_named(dense_sources, tmp_path, capsys, content):
    """An empty calibration_data file ended in datasets' DatasetGenerationError traceback."""
    empty, text = tmp_path / "domain.txt", tmp_path / "other.txt"
    empty.write_text(content)
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    recipe = _merge_yaml(tmp_path / "merge.yml", dense_sources, f"    calibration_data: {empty}\n",
                         gate_mode="calibration", second=f"    calibration_data: {text}\n")
    hostile()
    capsys.readouterr()
    assert cli(["merge", str(recipe), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert empty.name in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "out").exists()


# -- Conversions that cannot fit: refused before any work, with the numbers ------------------------------------------
@pytest.mark.subprocess
def test_a_conversion_to_2_to_the_40_experts_is_refused_at_once(dense_sources, tmp_path):
    """2**40 experts kept growing (memory, files) until the machine gave out (docs/checkpoints.md). The output is
    estimated from the dense model first, streaming and in memory. (In a child process with a bounded address space and
    a timeout: what failed here would otherwise take the machine with it.)"""
    out = tmp_path / "out"
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
            "from hf_moe.cli import main; "
            "argv = ['convert', sys.argv[1], sys.argv[2], '--num-experts', str(2**40), '--top-k', '2']; "
            "print('exit', main(argv), main(argv + ['--in-memory']), file=sys.stderr)")
    env = {**os.environ, "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    hostile(2)
    result = subprocess.run([sys.executable, "-c", code, dense_sources[0], str(out)], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=300)
    assert "exit 2 2" in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("HF_MOE_SKIP_SIZE_CHECK") == 2 and "244.0 PB in 1,099,511,627,783 files" in (
        result.stderr), result.stderr[-3000:]
    assert "more than the dense model" in result.stderr  # (the in-memory estimate)
    assert not out.exists() and not leftovers(out)


def test_a_conversion_larger_than_the_free_space_or_memory_is_refused(dense_sources, tmp_path, capsys, monkeypatch):
    """512 experts of the tiny model (more than 50 MB) against 50 MB free, and in memory against 50 MB available:
    refused with the sizes; HF_MOE_SKIP_SIZE_CHECK=1 goes ahead."""
    import hf_moe.convert.estimate as estimate

    monkeypatch.setattr(estimate, "free_space", lambda where: (50 << 20, None))
    monkeypatch.setattr(estimate, "available_memory", lambda: 50 << 20)
    out = tmp_path / "out"
    hostile(2)
    capsys.readouterr()
    assert cli(["convert", dense_sources[0], str(out), "--num-experts", "512", "--top-k", "2"]) == 2
    err = capsys.readouterr().err
    assert "MB" in err and "512 experts x 3 MoE layer(s)" in err and "52.4 MB free" in err, err
    refused(lambda: convert_to_moe(tiny_dense("llama"), num_experts=512, top_k=2), "52.4 MB of memory is available",
            "convert_checkpoint", error=ValueError)
    assert not out.exists() and not leftovers(out)
    monkeypatch.setenv("HF_MOE_SKIP_SIZE_CHECK", "1")
    assert cli(["convert", dense_sources[0], str(out), "--num-experts", "8", "--top-k", "2"]) == 0
    assert MoEForCausalLM.from_pretrained(out).config.num_experts == 8


def test_the_size_estimate_matches_what_is_written(dense_sources, tmp_path):
    """The estimate (bytes, files) against the checkpoint a conversion writes: within 1% of its tensors' bytes
    (headers, index, config and card are the rest), and its file count."""
    from hf_moe.dense_mlp import extract_mlp, find_decoder_layers, find_mlp
    from hf_moe.convert.api import _expert_sizes
    from hf_moe.convert.estimate import estimate_conversion

    for method, experts, shared in (("upcycle", 8, 1), ("split", 4, 0)):
        out = tmp_path / f"{method}-{experts}-{shared}"
        dense = tiny_dense("llama")
        _, layers = find_decoder_layers(dense)
        mlp = extract_mlp(layers[0], find_mlp(layers[0]), dense.config)
        sizes = _expert_sizes(method, mlp, experts, shared)
        size = estimate_conversion(sum(p.numel() * 4 for p in dense.parameters()), mlp, sizes, experts, len(layers),
                                   shared, 4, 5 << 30)
        convert_checkpoint(dense_sources[0], out, experts, 2, method=method, num_shared_experts=shared, progress=False)
        weights = sum(m["data_offsets"][1] - m["data_offsets"][0] for path in out.glob("*.safetensors")
                      for k, m in checkpoint.read_safetensors_header(path).items() if k != "__metadata__")
        assert abs(size.output_bytes - weights) < 0.01 * weights, (method, size, weights)
        assert size.files - 6 == len(list(out.glob("*.safetensors"))), (method, size.files)
        COUNTS["estimates"] += 1
