"""Hostile inputs to adapter experts, `materialize` and `convert --method lora|pesc`.

An adapter checkpoint holds only what was trained and loads onto its base, so the base is identified by everything
that changes what it computes (its weights and its config), a base that is not it is refused with hf_moe's
checkpoint error naming the fix, nothing writes into a directory that a checkpoint depends on, every dtype a model
loads in it runs in, a size a request implies is refused before anything is allocated, and options that make no
sense for a method are refused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import random_ids, tiny_dense, tiny_tokenizer

import hf_moe_cli
from hf_moe import CheckpointError, MoEForCausalLM, convert_to_moe
from hf_moe.checkpoint import record_config_files


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _randomize(model, seed: int = 0):
    """Non-zero B (lora) / U (pesc): the experts differ from the dense MLP and from each other."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_lora_B", "adapter_up")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A dense model and an adapter checkpoint of each method on it, made once; their logits on `random_ids()`."""
    root = tmp_path_factory.mktemp("built")
    tiny_dense("llama").save_pretrained(root / "dense")
    tiny_tokenizer().save_pretrained(root / "dense")
    refs = {}
    for method in ("lora", "pesc"):
        model = _randomize(convert_to_moe(root / "dense", num_experts=4, top_k=2, method=method, rank=4)).eval()
        model.save_pretrained(root / method)
        refs[method] = _logits(model, random_ids())
    return root, refs


@pytest.fixture
def dense_dir(built, tmp_path) -> Path:
    return Path(shutil.copytree(built[0] / "dense", tmp_path / "dense"))


@pytest.fixture
def save_adapters(built, dense_dir):
    """save_adapters(out, method="lora"): an adapter checkpoint of `method` on `dense_dir` at `out` (a copy of the one
    built, its base record pointing to `dense_dir`); returns its logits on `random_ids()`."""

    def save(out: Path, method: str = "lora") -> torch.Tensor:
        shutil.copytree(built[0] / method, out)
        _edit_base_record(out, name_or_path=str(dense_dir))
        return built[1][method]

    return save


def _edit_json(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def _edit_base_record(checkpoint: Path, **fields) -> None:
    """Edit `adapter_experts.base_model` in the checkpoint's config and record it (as `hf-moe verify --update`)."""
    config = json.loads((checkpoint / "config.json").read_text())
    config["adapter_experts"]["base_model"].update(fields)
    (checkpoint / "config.json").write_text(json.dumps(config))
    record_config_files(checkpoint)


# --------------------------------------------------------------------------------------------------------------
# The base: its config is part of what the adapters were trained on
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "edit,field",
    [
        (dict(rms_norm_eps=0.5), "rms_norm_eps"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 99.0}), "rope_parameters"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}), "rope_parameters"),
        (dict(num_key_value_heads=1), "num_key_value_heads"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_a_base_whose_config_computes_something_else_is_refused(dense_dir, save_adapters, tmp_path, edit, field):
    """Same weights, another config: the fingerprint of the weights matches, but the model computes something else
    (or, for the number of KV heads, cannot be built): hf_moe's checkpoint error names the field, before any weight
    of the base is read."""
    save_adapters(tmp_path / "adapters")
    edited = tmp_path / "edited"
    shutil.copytree(dense_dir, edited)
    _edit_json(edited / "config.json", **edit)
    with pytest.raises(CheckpointError, match=rf"config.*{field}.*base=PATH_OR_MODEL"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters", base=edited)
    shutil.rmtree(dense_dir)
    edited.rename(dense_dir)  # the recorded base itself edited in place
    with pytest.raises(CheckpointError, match=rf"config.*{field}"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters")


def test_a_base_model_object_with_another_config_is_refused(save_adapters, tmp_path):
    save_adapters(tmp_path / "adapters")
    other = tiny_dense("llama", rms_norm_eps=0.25)  # same weights (seed 0), another norm epsilon
    with pytest.raises(CheckpointError, match=r"rms_norm_eps"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters", base=other)


def test_edits_that_change_nothing_computed_still_load(dense_dir, save_adapters, tmp_path):
    """What does not change the computation (the cache switch, bookkeeping, special token ids) is not part of the
    base's identity: the checkpoint loads and gives the same logits."""
    ref = save_adapters(tmp_path / "adapters")
    _edit_json(dense_dir / "config.json", use_cache=False, architectures=["LlamaForCausalLM", "X"],
               transformers_version="0.0.1", pad_token_id=5, initializer_range=0.5, output_hidden_states=True)
    loaded = MoEForCausalLM.from_pretrained(tmp_path / "adapters")
    torch.testing.assert_close(_logits(loaded, random_ids()), ref, rtol=0, atol=0)


@pytest.mark.parametrize("bad", ["float33", "nn", "Tensor", "int8", 5, ["float32"]])
def test_a_bad_recorded_base_dtype_is_a_checkpoint_error(save_adapters, tmp_path, bad):
    save_adapters(tmp_path / "adapters")
    _edit_base_record(tmp_path / "adapters", dtype=bad)
    with pytest.raises(CheckpointError, match=r"adapter_experts\.base_model\.dtype.*float32"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters")


# --------------------------------------------------------------------------------------------------------------
# Where the base is
# --------------------------------------------------------------------------------------------------------------
def test_a_base_that_is_a_file_or_a_link_loop_says_so(save_adapters, tmp_path):
    save_adapters(tmp_path / "adapters")
    (tmp_path / "a-file").write_text("not a model")
    with pytest.raises(CheckpointError, match=r"a-file.* is a file, not a directory"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters", base=tmp_path / "a-file")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    with pytest.raises(CheckpointError, match=r"loop.* symbolic link.*loop"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters", base=tmp_path / "loop")


def test_a_recorded_relative_base_path_is_the_checkpoints_neighbour(dense_dir, save_adapters, tmp_path,
                                                                    monkeypatch):
    """A relative path recorded for the base (written by hand, or by a tool that keeps the pair movable) names a
    directory relative to the checkpoint, whatever the current directory is."""
    ref = save_adapters(tmp_path / "adapters")
    _edit_base_record(tmp_path / "adapters", name_or_path="../dense")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "dense").mkdir(parents=True)  # a decoy the current directory would find
    monkeypatch.chdir(elsewhere)
    loaded = MoEForCausalLM.from_pretrained(tmp_path / "adapters")
    torch.testing.assert_close(_logits(loaded, random_ids()), ref, rtol=0, atol=0)
    shutil.move(dense_dir, tmp_path / "moved")
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'dense'}.* not there \(was it moved\?\)"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters")
    # loaded onto the base at its new place, a save records that place
    MoEForCausalLM.from_pretrained(tmp_path / "adapters", base="../moved").save_pretrained(tmp_path / "resaved")
    torch.testing.assert_close(_logits(MoEForCausalLM.from_pretrained(tmp_path / "resaved"), random_ids()), ref,
                               rtol=0, atol=0)


def test_base_given_as_a_model_object_is_left_untouched(save_adapters, tmp_path):
    """from_pretrained(dir, base=model) builds on a copy: the caller's dense model keeps its class, weights and
    trainability, and a second load onto it works."""
    ref = save_adapters(tmp_path / "adapters")
    dense = tiny_dense("llama")
    cls, before = type(dense), {k: v.clone() for k, v in dense.state_dict().items()}
    dense_ref = _logits(dense, random_ids())
    first = MoEForCausalLM.from_pretrained(tmp_path / "adapters", base=dense)
    second = MoEForCausalLM.from_pretrained(tmp_path / "adapters", base=dense, dtype=torch.float64)
    assert first is not dense and type(dense) is cls and all(p.requires_grad for p in dense.parameters())
    assert dense.state_dict().keys() == before.keys()
    assert all(torch.equal(dense.state_dict()[k], v) for k, v in before.items())
    torch.testing.assert_close(_logits(dense, random_ids()), dense_ref, rtol=0, atol=0)
    torch.testing.assert_close(_logits(first, random_ids()), ref, rtol=0, atol=0)
    assert second.dtype == torch.float64 and dense.dtype == torch.float32
    with pytest.raises(CheckpointError, match=r"already an hf_moe model.*dense"):
        MoEForCausalLM.from_pretrained(tmp_path / "adapters", base=first)


# --------------------------------------------------------------------------------------------------------------
# No command writes into a directory a checkpoint depends on
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out", ["dense", "dense/plain", "adapters/plain", ".", "link-to-dense"])
def test_materialize_never_writes_into_the_base_or_the_source(dense_dir, save_adapters, tmp_path, capsys, out):
    ref = save_adapters(tmp_path / "adapters")
    os.symlink(dense_dir, tmp_path / "link-to-dense")
    before = sorted(p.name for p in dense_dir.iterdir())
    assert hf_moe_cli.main(["materialize", str(tmp_path / "adapters"), str(tmp_path / out)]) == 2
    assert "choose another out" in capsys.readouterr().err.lower()
    assert sorted(p.name for p in dense_dir.iterdir()) == before
    assert not (tmp_path / out / "model-expert-00000.safetensors").exists()
    loaded = MoEForCausalLM.from_pretrained(tmp_path / "adapters")
    torch.testing.assert_close(_logits(loaded, random_ids()), ref, rtol=0, atol=0)


def test_an_adapter_model_is_not_saved_over_its_base(dense_dir, tmp_path):
    """save_pretrained of an adapter model into its base's directory (or one that holds it) would replace the weights
    the save refers to: refused, the base unchanged."""
    model = convert_to_moe(dense_dir, num_experts=4, top_k=2, method="lora", rank=4)
    for target in (dense_dir, tmp_path):
        with pytest.raises(ValueError, match=r"base.*choose another directory"):
            model.save_pretrained(target)
    assert (dense_dir / "model.safetensors").is_file() and not (dense_dir / "model-expert-00000.safetensors").exists()


@pytest.mark.parametrize("out", ["dense", "dense/adapters", "."])
def test_convert_to_adapters_never_writes_into_the_dense_model(dense_dir, tmp_path, capsys, out):
    before = sorted(p.name for p in dense_dir.iterdir())
    assert hf_moe_cli.main(["convert", str(dense_dir), str(tmp_path / out), "--num-experts", "4", "--top-k", "2",
                            "--method", "lora", "--rank", "2"]) == 2
    assert "choose another out" in capsys.readouterr().err.lower()
    assert sorted(p.name for p in dense_dir.iterdir()) == before


# --------------------------------------------------------------------------------------------------------------
# Every dtype a model loads in, it runs in
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["lora", "pesc"])
def test_adapter_models_run_in_bf16(save_adapters, tmp_path, method):
    ref = save_adapters(tmp_path / "adapters", method)
    model = MoEForCausalLM.from_pretrained(tmp_path / "adapters", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    logits = _logits(model, random_ids())
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), ref, rtol=0, atol=0.05 * ref.abs().max().item())
    ids = random_ids()
    model.train()(input_ids=ids, labels=ids).loss.backward()  # the fp32 adapters get fp32 gradients
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.endswith(("_lora_A", "adapter_down")) and p.dtype == torch.float32 for n, p in trained.items())
    assert all(p.grad is not None and p.grad.dtype == p.dtype and p.grad.isfinite().all() for p in trained.values())


@pytest.mark.slow
def test_cli_converts_and_generates_adapter_models_in_bf16(dense_dir, tmp_path, capsys):
    out = tmp_path / "adapters"
    assert hf_moe_cli.main(["convert", str(dense_dir), str(out), "--num-experts", "4", "--top-k", "2", "--method",
                            "lora", "--rank", "2", "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["adapter_experts"]["base_model"]["dtype"] == "bfloat16"
    assert MoEForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    capsys.readouterr()
    assert hf_moe_cli.main(["generate", str(out), "hello", "--max-new-tokens", "4", "--dtype", "bf16"]) == 0
    assert "tokens: prefill" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------
# Sizes a request implies, and options that make no sense for the method
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["lora", "pesc"])
def test_a_rank_too_large_for_memory_is_refused_before_allocation(monkeypatch, method):
    """The adapters of rank 20000 on this tiny model take 460 MB (lora) / 123 MB (pesc): with 50 MB available the
    conversion is refused, with the sizes and what to do, before a single adapter exists."""
    from hf_moe.convert import estimate

    monkeypatch.setattr(estimate, "available_memory", lambda: 50_000_000)
    monkeypatch.delenv(estimate.SKIP_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=r"(?s)about \d+\.\d [MG]B.*50\.0 MB.*rank 20000.*smaller rank"):
        convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method=method, rank=20000)
    convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method=method, rank=4)  # a small one fits


def test_materialize_refuses_plain_experts_too_large_for_memory(dense_dir, tmp_path, monkeypatch):
    """Plain experts are E whole MLPs per layer: what they would take is checked against the memory available
    before any is formed, and the adapter model is left as it was."""
    from hf_moe.convert import estimate, materialize

    model = _randomize(convert_to_moe(dense_dir, num_experts=4, top_k=2, method="lora", rank=4)).eval()
    ref = _logits(model, random_ids())
    monkeypatch.setattr(materialize, "available_memory", lambda: 100_000)
    monkeypatch.delenv(estimate.SKIP_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=r"(?s)about \d+\.\d [KM]B.*4 plain experts x 3 MoE layer.*100\.0 KB"):
        materialize.materialize(model)
    assert model.config.adapter_experts is not None
    torch.testing.assert_close(_logits(model, random_ids()), ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    "method,options,error",
    [
        ("lora", dict(partition="kmeans"), r"\['partition'\] only apply to method='split'"),
        ("pesc", dict(partition="random"), r"\['partition'\] only apply to method='split'"),
        ("lora", dict(noise=0.0), r"\['noise'\] only apply to method='upcycle'"),
        ("pesc", dict(reinit_fraction=0.0), r"\['reinit_fraction'\] only apply to method='upcycle'"),
        ("lora", dict(calibration_tokens=4096), r"\['calibration_tokens'\] only apply to method='split'"),
        ("lora", dict(adapter_act="gelu"), r"\['adapter_act'\] only apply to method='pesc'"),
        ("pesc", dict(target_modules=["up_proj"]), r"\['target_modules'\] only apply to method='lora'"),
        ("upcycle", dict(rank=16), r"only apply to method='lora'"),
        ("split", dict(lora_dropout=0.0), r"only apply to method='lora'"),
    ],
)
def test_options_of_another_method_are_refused_whatever_their_value(method, options, error):
    """An option given for another method is refused even when its value is that method's default: it would be
    silently ignored."""
    with pytest.raises(ValueError, match=error):
        convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method=method, **options)


def test_cli_refuses_split_options_with_adapters(dense_dir, tmp_path, capsys):
    for method, flags in (("lora", ["--partition", "kmeans"]), ("pesc", ["--calibration-tokens", "64"]),
                          ("lora", ["--noise", "0"])):
        assert hf_moe_cli.main(["convert", str(dense_dir), str(tmp_path / "out"), "--num-experts", "4", "--top-k",
                                "2", "--method", method, *flags]) == 2
        assert f"only apply to method=" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
