"""Merging dense models into one MoE (hf_moe/convert/merge*.py): mergekit-moe's YAML, exactness, refusals before any
weight is read, streaming memory, export of a merge, routing per domain."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CORPUS, random_ids, tiny_dense, tiny_tokenizer

import hf_moe
from hf_moe import MoEForCausalLM
from hf_moe.cli import main as cli
from hf_moe.convert import stream
from hf_moe.convert.merge import merge_to_moe
from hf_moe.convert.merge_config import MergeConfigError, parse_merge_config
from hf_moe.convert.merge_gates import calibration_rows

PROMPTS = ["the quick brown fox", "a mixture of experts", "sparse models grow", "rivers carry water"]


def _save(model, path, tokenizer=True):
    model.save_pretrained(path)
    if tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A base Llama and three 'fine-tunes' of it (other seeds: the same shapes, other weights)."""
    root = tmp_path_factory.mktemp("sources")
    return [_save(tiny_dense("llama", seed=i), root / f"m{i}") for i in range(4)]


def _recipe(sources, **fields):
    experts = [{"source_model": s, "positive_prompts": [p]} for s, p in zip(sources[1:], PROMPTS)]
    return {"base_model": sources[0], "experts": experts, "dtype": "float32", **fields}


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits


# ---------------------------------------------------------------------------------------------------- the YAML
def test_mergekit_yaml_with_every_field_merges_and_records_the_recipe(sources, tmp_path):
    config = textwrap.dedent(f"""\
        base_model: {sources[0]}
        architecture: qwen
        gate_mode: hidden
        dtype: float32
        experts_per_token: 2
        experts:
          - source_model: {sources[1]}
            positive_prompts: ["the quick brown fox"]
            negative_prompts: ["a mixture of experts"]
          - source_model:
              model: {{path: {sources[2]}}}
            positive_prompts: ["a mixture of experts"]
            noise_scale: 0.01
            residual_scale: 0.9
        shared_experts:
          - source_model: {sources[3]}
            positive_prompts: ["sparse models grow"]
            residual_scale: 0.5
        # hf_moe's own fields, beside mergekit's
        non_expert_weights: average
        router_aux_loss_coef: 0.02
        seed: 3
        """)
    (tmp_path / "merge.yml").write_text(config)
    assert cli(["merge", str(tmp_path / "merge.yml"), str(tmp_path / "out")]) == 0
    moe = MoEForCausalLM.from_pretrained(tmp_path / "out")
    c = moe.config
    assert (c.num_experts, c.num_experts_per_tok, c.num_shared_experts, c.shared_expert_gate) == (2, 2, 1, True)
    assert c.router_aux_loss_coef == 0.02 and c.moe_layers == [0, 1, 2]
    assert c.moe_conversion["method"] == "merge" and c.moe_conversion["recipe"]["non_expert_weights"] == "average"
    assert yaml.safe_load((tmp_path / "out" / "hf_moe_merge.yml").read_text())["experts"][1]["residual_scale"] == 0.9
    assert (tmp_path / "out" / "tokenizer.json").is_file() and "merge" in (tmp_path / "out" / "README.md").read_text()
    # residual_scale scales the shared expert's down projection
    shared_src = MoEForCausalLM  # noqa: F841  (names only)
    dense = hf_moe.convert_to_moe  # noqa: F841
    from safetensors.torch import load_file

    down = load_file(os.path.join(sources[3], "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    torch.testing.assert_close(moe.model.layers[1].mlp.shared_experts.down_proj.weight.data, 0.5 * down)


GATE_MODES = ["hidden", "hidden_avg", "cheap_embed", "random", "uniform_random", "calibration"]


@pytest.mark.parametrize("gate_mode", GATE_MODES)
def test_every_gate_mode(sources, tmp_path, gate_mode):
    merge_to_moe(_recipe(sources, gate_mode=gate_mode), tmp_path / "out", progress=False)
    moe = MoEForCausalLM.from_pretrained(tmp_path / "out")
    rows = torch.stack([moe.model.layers[i].mlp.gate.weight for i in range(3)])  # [L, E, H]
    assert rows.shape == (3, 3, 64) and torch.isfinite(rows).all()
    if gate_mode in ("hidden", "hidden_avg", "cheap_embed"):
        torch.testing.assert_close(rows.norm(dim=-1), torch.ones(3, 3), atol=1e-2, rtol=0)  # bf16 hidden states
    if gate_mode == "cheap_embed":  # the same row in every layer
        assert torch.equal(rows[0], rows[2])
    if gate_mode == "calibration":
        assert len(moe.config.moe_conversion["calibration"]["top1_own_expert"]) == 3
    assert torch.isfinite(_logits(moe, random_ids())).all()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"gate_mode": "nearest"}, "gate_mode='nearest' is not one of"),
        ({"architecture": "gpt"}, "architecture='gpt' is not one of"),
        ({"experts_per_token": 4}, "experts_per_token=4 but only 3 experts"),
        ({"unknown_field": 1}, "Unknown field(s) ['unknown_field']"),
        ({"non_expert_weights": "mean"}, "non_expert_weights must be one of"),
        ({"shared_experts": [{"source_model": "x"}], "architecture": "mixtral"}, "architecture=mixtral has no shared"),
        ({"shared_experts": [{"source_model": "x", "positive_prompts": ["a"]}], "architecture": "deepseek"},
         "deepseek does not gate"),
    ],
)
def test_bad_recipes_are_refused_with_the_field_named(sources, change, message):
    with pytest.raises(MergeConfigError) as err:
        parse_merge_config({**_recipe(sources), **change})
    assert message in str(err.value)


def test_same_prompts_for_every_expert_is_refused_as_mergekit_does(sources):
    experts = [{"source_model": s, "positive_prompts": ["same"]} for s in sources[1:]]
    with pytest.raises(MergeConfigError, match="same positive and negative prompts"):
        parse_merge_config({"base_model": sources[0], "experts": experts})


# ---------------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("top_k, non_expert", [(1, "base"), (2, "base"), (3, "average")])
def test_copies_of_one_model_merge_to_that_model(sources, tmp_path, top_k, non_expert):
    experts = [{"source_model": sources[1]} for _ in range(3)]
    recipe = {"base_model": sources[1], "experts": experts, "gate_mode": "random", "experts_per_token": top_k,
              "non_expert_weights": non_expert, "dtype": "float32"}
    merge_to_moe(recipe, tmp_path / "out", progress=False)
    dense = tiny_dense("llama", seed=1)
    moe = MoEForCausalLM.from_pretrained(tmp_path / "out")
    ids = random_ids()
    # sum_j w_j * MLP(x) with sum_j w_j = 1 (top-1: w = p / p = 1 exactly); the experts' kernels sum the products
    # of each dot product in another order than nn.Linear: fp32 rounding, a few ulps of the logits.
    torch.testing.assert_close(_logits(moe, ids), _logits(dense, ids), rtol=0, atol=2e-5)
    for name, param in dense.named_parameters():  # averaged in fp64: N equal copies average to the copy, exactly
        if ".mlp." not in name:
            assert torch.equal(param, moe.get_parameter(name)), name


@pytest.mark.parametrize("model_type", ["gpt2", "phi3", "opt"])  # Conv1D + biases, fused gate_up, MLP in the layer
def test_copies_merge_to_the_model_in_other_families(tmp_path, model_type):
    path = _save(tiny_dense(model_type, seed=1), tmp_path / "m")
    recipe = {"base_model": path, "experts": [{"source_model": path, "calibration_data": None,
                                                "positive_prompts": [p]} for p in PROMPTS[:3]],
              "gate_mode": "calibration", "non_expert_weights": "average", "dtype": "float32"}
    merge_to_moe(recipe, tmp_path / "out", progress=False)
    moe = MoEForCausalLM.from_pretrained(tmp_path / "out")
    assert moe.config.moe_conversion["max_abs_expert_diff"] < 1e-6
    ids = random_ids()
    torch.testing.assert_close(_logits(moe, ids), _logits(tiny_dense(model_type, seed=1), ids), rtol=0, atol=2e-5)


def test_routing_every_token_to_expert_i_gives_source_i_mlp(sources, tmp_path):
    merge_to_moe(_recipe(sources, non_expert_weights="average"), tmp_path / "out", progress=False)
    moe = MoEForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randn(10, 64)
    for i in range(3):
        source = tiny_dense("llama", seed=i + 1)
        for layer in range(3):
            experts = moe.model.layers[layer].mlp.experts
            with torch.no_grad():
                got = experts(x, torch.full((10, 1), i), torch.ones(10, 1))
                expected = source.model.layers[layer].mlp(x)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_calibration_rows_classify_their_sources():
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 32, generator=generator) * 2 + 5  # a large common offset, as real hidden states have
    labels = torch.arange(3).repeat_interleave(200)
    x = centres[labels] + torch.randn(600, 32, generator=generator)
    rows = calibration_rows(x, labels, 3)
    assert (x @ rows.t()).argmax(-1).eq(labels).float().mean() > 0.95
    torch.testing.assert_close(rows.sum(0), torch.zeros(32), atol=1e-4, rtol=0)  # centred
    probs = (x @ rows.t()).softmax(-1)
    assert 0.5 < probs.gather(1, labels[:, None]).mean() < 1.0  # calibrated, neither flat nor one-hot


# ---------------------------------------------------------------------------------------------------- refusals
def _refusal(tmp_path, sources, other, monkeypatch, capsys) -> str:
    """Run `hf-moe merge` with `other` as the second expert; no weight may be read, and it must exit 2."""
    def no_read(self, key):
        raise AssertionError(f"a weight ({key}) was read before the refusal")

    monkeypatch.setattr(stream._SafetensorsSource, "read", no_read)
    recipe = _recipe(sources)
    recipe["experts"][1]["source_model"] = other
    (tmp_path / "merge.yml").write_text(yaml.safe_dump(recipe))
    assert cli(["merge", str(tmp_path / "merge.yml"), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "model_type, overrides, message",
    [
        ("qwen2", {}, "architecture mismatch"),
        ("llama", {"intermediate_size": 128}, "shape mismatch"),
        ("llama", {"vocab_size": 120}, "vocabulary mismatch"),
    ],
)
def test_other_architecture_shape_or_vocabulary_is_refused_before_any_weight(
    sources, tmp_path, monkeypatch, capsys, model_type, overrides, message
):
    other = _save(tiny_dense(model_type, **overrides), tmp_path / "other")
    err = _refusal(tmp_path, sources, other, monkeypatch, capsys)
    assert message in err and "other" in err


def test_other_tokenizer_is_refused_before_any_weight(sources, tmp_path, monkeypatch, capsys):
    other = _save(tiny_dense("llama", seed=2), tmp_path / "other", tokenizer=False)
    tokenizer = tiny_tokenizer()
    vocab = json.loads(tokenizer.backend_tokenizer.to_str())
    model = vocab["model"]["vocab"]
    model["a"], model["b"] = model["b"], model["a"]  # two tokens swap ids
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    swapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(vocab)))
    swapped.save_pretrained(other)
    err = _refusal(tmp_path, sources, other, monkeypatch, capsys)
    assert "tokenizer mismatch" in err and "'a'" in err


def test_a_stored_tensor_of_another_shape_is_refused_before_any_weight(sources, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file, save_file

    other = _save(tiny_dense("llama", seed=2), tmp_path / "other")
    tensors = load_file(os.path.join(other, "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:80].contiguous()
    save_file(tensors, os.path.join(other, "model.safetensors"), metadata={"format": "pt"})
    err = _refusal(tmp_path, sources, other, monkeypatch, capsys)
    assert "shape mismatch" in err and "model.layers.1.mlp.up_proj.weight" in err


# ---------------------------------------------------------------------------------------------------- streaming
@pytest.mark.slow
def test_merge_reads_one_tensor_of_one_source_at_a_time(tmp_path, monkeypatch):
    """What a merge holds of its sources at once: at most one MLP (three projections) of one layer of one source,
    whatever the number of sources and layers."""
    config = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, vocab_size=128)
    paths = [_save(tiny_dense("llama", seed=i, **config), tmp_path / f"s{i}") for i in range(4)]
    live, peak = {}, [0]
    read = stream._SafetensorsSource.read

    def tracked(self, key):
        tensor = read(self, key)
        live[id(tensor)] = tensor.nbytes
        weakref.finalize(tensor, live.pop, id(tensor), None)
        peak[0] = max(peak[0], sum(live.values()))
        return tensor

    monkeypatch.setattr(stream._SafetensorsSource, "read", tracked)
    for gate_mode, average in (("hidden", "base"), ("calibration", "average")):
        peak[0] = 0
        merge_to_moe(_recipe(paths, gate_mode=gate_mode, non_expert_weights=average), tmp_path / gate_mode,
                     progress=False)
        gc.collect()
        mlp = 3 * 64 * 256 * 4
        source = os.path.getsize(os.path.join(paths[0], "model.safetensors"))
        assert peak[0] <= mlp, (gate_mode, peak[0], mlp)
        assert peak[0] < source / 5


@pytest.mark.subprocess
@pytest.mark.slow
def test_peak_memory_of_a_merge_is_a_fraction_of_one_source(tmp_path):
    """Peak RSS growth of a merge of 3 sources of 120 MB (fp32) and a base, in a fresh process, over its RSS before
    (after a first merge has imported and initialised everything). Tensors are allocated with mmap (so RSS follows
    the live tensors, not what the allocator keeps), as benchmarks/merge.py measures against mergekit."""
    config = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, vocab_size=128)
    paths = [_save(tiny_dense("llama", seed=i, **config), tmp_path / f"s{i}") for i in range(4)]
    source = os.path.getsize(os.path.join(paths[0], "model.safetensors"))
    (tmp_path / "merge.yml").write_text(yaml.safe_dump(_recipe(paths, gate_mode="hidden")))
    (tmp_path / "warm.yml").write_text(yaml.safe_dump(_recipe(paths, gate_mode="hidden", layers=[0])))
    script = textwrap.dedent(f"""\
        import re
        from hf_moe.convert.merge import merge_to_moe
        merge_to_moe({str(tmp_path / 'warm.yml')!r}, {str(tmp_path / 'warm')!r}, progress=False)  # imports, first use
        status = lambda key: int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
        open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current RSS
        before = status("VmRSS")
        merge_to_moe({str(tmp_path / 'merge.yml')!r}, {str(tmp_path / 'out')!r}, progress=False)
        print(status("VmHWM") - before)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_MOE_BACKEND": "torch", "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert done.returncode == 0, done.stderr[-3000:]
    growth = int(done.stdout.split()[-1])
    print(f"growth {growth / 1e6:.1f} MB, source {source / 1e6:.1f} MB")
    assert growth < 0.35 * source, f"peak RSS grew by {growth / 1e6:.1f} MB; one source is {source / 1e6:.1f} MB"


# ---------------------------------------------------------------------------------------------------- export
@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, fields, architecture",
    [
        ("llama", {}, "MixtralForCausalLM"),
        ("llama", {"architecture": "qwen", "shared_experts": "gated"}, "Qwen2MoeForCausalLM"),
        ("qwen2", {"architecture": "qwen", "shared_experts": "gated"}, "Qwen2MoeForCausalLM"),
        ("qwen3", {"architecture": "qwen"}, "Qwen3MoeForCausalLM"),
    ],
)
def test_a_merge_exports_to_the_native_family(tmp_path, model_type, fields, architecture):
    from transformers import AutoModelForCausalLM

    paths = [_save(tiny_dense(model_type, seed=i), tmp_path / f"s{i}") for i in range(4)]
    recipe = _recipe(paths[:3], **fields)
    if fields.get("shared_experts") == "gated":
        recipe["shared_experts"] = [{"source_model": paths[3], "positive_prompts": ["rivers"], "residual_scale": 0.5}]
    merge_to_moe(recipe, tmp_path / "moe", progress=False)
    assert cli(["export", str(tmp_path / "moe"), str(tmp_path / "native")]) == 0
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "native")
    assert type(native).__name__ == architecture
    moe = MoEForCausalLM.from_pretrained(tmp_path / "moe")
    ids = random_ids()
    torch.testing.assert_close(_logits(native, ids), _logits(moe, ids), rtol=0, atol=1e-5)


def test_an_ungated_shared_expert_does_not_export(sources, tmp_path, capsys):
    recipe = _recipe(sources[:3], architecture="deepseek", shared_experts=[{"source_model": sources[3]}])
    merge_to_moe(recipe, tmp_path / "moe", progress=False)
    assert cli(["export", str(tmp_path / "moe"), str(tmp_path / "native")]) == 2
    assert "num_shared_experts=1" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- routing
def test_inspect_shows_which_expert_each_domain_goes_to(sources, tmp_path, capsys):
    files = []
    for i, text in enumerate(CORPUS.split(". ")[:3]):
        files.append(tmp_path / f"domain{i}.txt")
        files[-1].write_text(text * 5)
    merge_to_moe(_recipe(sources, gate_mode="cheap_embed"), tmp_path / "moe", progress=False)
    assert cli(["inspect", str(tmp_path / "moe"), "--routing", "--data", *map(str, files),
                "--heatmap", str(tmp_path / "h.png")]) == 0
    out = capsys.readouterr().out
    assert "routing by domain" in out and "domain2.txt" in out and "e0=m1" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("0 domain", "2 domain"))]
    assert len(rows) == 6


# ---------------------------------------------------------------------------------------------------- benchmark
@pytest.mark.subprocess
@pytest.mark.slow
def test_merge_benchmark_quality_smoke_run(tmp_path):
    """benchmarks/merge.py quality --smoke: every contestant trains, merges and is evaluated (tiny sizes), and the
    report says whether BTX's claims hold."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "merge.py")
    done = subprocess.run([sys.executable, script, "quality", "--smoke", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_MOE_BACKEND": "torch"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "merge_quality.md").read_text()
    for row in ("| hidden |", "| calib |", "| btx |", "| upcycled |", "| dense |", "| branch pycode |"):
        assert row in report, row
    assert "BTX's claim" in report
    run = json.loads((tmp_path / "merge_quality_runs.jsonl").read_text().splitlines()[0])
    assert set(run["own_expert"]["btx"]) == {"kjv", "pydocs", "pycode", "best"}


def test_sources_named_by_hub_id_merge_from_their_cached_snapshots(sources, tmp_path, monkeypatch):
    """mergekit's `org/name` and `org/name@revision` sources resolve through the same code as a checkpoint loaded by
    its Hub id (hf_moe.checkpoint.hub.resolve_checkpoint: the cache's refs checked); offline, an id the cache lacks is
    refused naming it."""
    import huggingface_hub.constants as constants
    from conftest import hub_cache

    from hf_moe.convert.merge_checks import localize
    from hf_moe.convert.merge_config import load_merge_config

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    base = hub_cache(Path(sources[0]), cache, repo="org/base")
    tuned = hub_cache(Path(sources[1]), cache, repo="org/tuned", revision="v1")
    recipe = localize(load_merge_config(_recipe(["org/base", "org/tuned@v1", sources[2]])))
    assert recipe.base_model == str(base.resolve())
    assert [e.source_model for e in recipe.experts] == [str(tuned.resolve()), sources[2]]
    merge_to_moe(_recipe(["org/base", "org/tuned@v1", sources[2]]), tmp_path / "out", progress=False)
    assert MoEForCausalLM.from_pretrained(tmp_path / "out").config.num_experts == 2
    with pytest.raises(FileNotFoundError, match="'org/missing' is not a local directory"):
        merge_to_moe(_recipe(["org/base", "org/missing", sources[2]]), tmp_path / "out2", progress=False)
    assert not (tmp_path / "out2").exists()
