"""Shrinking an MoE after training (hf_moe/shrink/): fewer experts by pruning or merging, for hf_moe checkpoints and
transformers' own MoE checkpoints; dynamic skipping (router_skip_threshold)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import CORPUS, VOCAB, random_ids, tiny_dense, tiny_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import hf_moe
from hf_moe import MoEConfig, MoEForCausalLM, ShrinkError
from hf_moe.cli import main as cli
from hf_moe.layers import SparseMoeBlock
from hf_moe.shrink.layer import LayerData, combine, expert_outputs, route, router_state
from hf_moe.shrink.merge import groups_for, logit_correlation, match_neurons, merge_layer, neuron_features, permuted
from hf_moe.shrink.select import Reconstruction, frequency_subset

NATIVE = {  # tiny native MoE configs: 4 experts, top-2
    "mixtral": dict(num_local_experts=4, intermediate_size=24),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=32,
                      intermediate_size=48),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=24, norm_topk_prob=True, head_dim=16),
    "olmoe": dict(num_experts=4, intermediate_size=24, eos_token_id=2, pad_token_id=0),
}


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(CORPUS * 3)  # ~500 characters: the character-level tokenizer gives a token each
    return str(path)


@pytest.fixture(scope="module")
def moe_dir(tiny_moe):
    """A tiny hf_moe checkpoint: a Llama upcycled to 4 experts top-2, with noise so that the experts differ (conftest's
    tiny_moe, read-only)."""
    return str(tiny_moe.path)


def _native_dir(root, model_type: str) -> str:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2,
                                  **NATIVE[model_type])
    path = root / model_type
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


# ----------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("method", ["reconstruction", "loss", "merge", "frequency", "random"])
def test_keeping_every_expert_returns_the_same_logits(moe_dir, calib, tmp_path, method):
    ids = random_ids()
    result = hf_moe.shrink(moe_dir, tmp_path / "out", 4, method, calib, progress=False)
    assert [c.kept for c in result.layers.values()] == [[0, 1, 2, 3]] * 3
    shrunk = MoEForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(_logits(shrunk, ids), _logits(MoEForCausalLM.from_pretrained(moe_dir), ids))


def test_keeping_every_expert_of_a_native_mixtral_returns_the_same_logits(tmp_path, calib):
    source = _native_dir(tmp_path, "mixtral")
    hf_moe.shrink(source, tmp_path / "out", 4, "merge", calib, progress=False)
    ids = random_ids()
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out"), ids),
                       _logits(AutoModelForCausalLM.from_pretrained(source), ids))


# ------------------------------------------------------------------------------------------- the outputs
def test_hf_moe_output_is_a_verified_per_expert_checkpoint_that_generates(moe_dir, calib, tmp_path):
    out = tmp_path / "small"
    result = hf_moe.shrink(moe_dir, out, 2, "reconstruction", calib, progress=False)
    assert sorted(p.name for p in out.glob("model-expert-*")) == ["model-expert-00000.safetensors",
                                                                  "model-expert-00001.safetensors"]
    assert hf_moe.checkpoint.verify_checkpoint(out).problems == []
    model = MoEForCausalLM.from_pretrained(out)
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (2, 2)
    record = model.config.moe_conversion["shrink"]
    assert record["method"] == "reconstruction" and record["kept"] == {str(i): c.kept for i, c in result.layers.items()}
    assert json.loads((out / "shrink.json").read_text())["keep"] == 2
    # the kept experts are the source's, bit for bit, renumbered; the router rows are the kept rows
    source = MoEForCausalLM.from_pretrained(moe_dir)
    for i, choice in result.layers.items():
        old, new = source.model.layers[i].mlp, model.model.layers[i].mlp
        assert torch.equal(new.experts.gate_up_proj, old.experts.gate_up_proj[choice.kept])
        assert torch.equal(new.gate.weight, old.gate.weight[choice.kept])
    generated = model.generate(random_ids(1, 4), max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 7)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(NATIVE))
def test_native_output_loads_in_transformers_and_generates(tmp_path, calib, model_type):
    """The output of a native checkpoint is that family's checkpoint with 3 experts (top-1 when keep=1, said)."""
    source = _native_dir(tmp_path, model_type)
    result = hf_moe.shrink(source, tmp_path / "out", 3, "merge", calib, progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == type(AutoModelForCausalLM.from_pretrained(source)).__name__
    block = model.model.layers[0].mlp
    assert block.experts.gate_up_proj.shape[0] == 3 == block.gate.weight.shape[0]
    assert len(result.layers) == 2
    assert model.generate(random_ids(1, 4), max_new_tokens=3, do_sample=False).shape == (1, 7)
    if model_type == "qwen2_moe":  # the shared expert stays as it is
        old = AutoModelForCausalLM.from_pretrained(source).model.layers[0].mlp
        assert torch.equal(model.model.layers[0].mlp.shared_expert.up_proj.weight, old.shared_expert.up_proj.weight)
    with pytest.warns(UserWarning, match="top-k lowered from 2 to 1"):
        hf_moe.shrink(source, tmp_path / "one", 1, "frequency", calib, progress=False)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "one").config.num_experts_per_tok == 1


@pytest.mark.subprocess
@pytest.mark.slow
def test_native_output_loads_without_hf_moe(tmp_path, calib, fresh_python):
    source = _native_dir(tmp_path, "mixtral")
    hf_moe.shrink(source, tmp_path / "out", 2, "random", progress=False)
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'out')!r}); "
            "assert 'hf_moe' not in sys.modules; print(type(m).__name__, m.config.num_local_experts)")
    done = fresh_python.run(code, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["MixtralForCausalLM", "2"]


def test_global_scope_keeps_the_same_experts_in_every_layer(moe_dir, calib, tmp_path):
    for method in ("reconstruction", "random"):
        result = hf_moe.shrink(moe_dir, tmp_path / method, 2, method, calib, scope="global", progress=False)
        kept = [c.kept for c in result.layers.values()]
        assert len(kept) == 3 and all(k == kept[0] for k in kept) and len(kept[0]) == 2


def test_random_is_the_seeded_baseline_and_top_k_is_lowered_and_said(moe_dir, tmp_path):
    """random reads no text; a seed gives the same experts again, other seeds others; keep 1 of a top-2 model is
    top-1, with a warning."""
    def kept(seed, name):
        with pytest.warns(UserWarning, match="top-k lowered from 2 to 1"):
            result = hf_moe.shrink(moe_dir, tmp_path / name, 1, "random", seed=seed, progress=False)
        return [c.kept for c in result.layers.values()]

    first = kept(0, "a")
    assert first == kept(0, "b") and all(len(k) == 1 for k in first)
    assert any(kept(seed, f"s{seed}") != first for seed in (1, 2, 3))
    model = MoEForCausalLM.from_pretrained(tmp_path / "a")
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (1, 1)
    assert model.generate(random_ids(1, 4), max_new_tokens=3, do_sample=False).shape == (1, 7)


@pytest.mark.slow
def test_the_cli_shrinks_and_reports(moe_dir, calib, tmp_path, capsys):
    assert cli(["shrink", moe_dir, str(tmp_path / "out"), "--keep", "3", "--method", "merge", "--data", calib]) == 0
    printed = capsys.readouterr().out
    assert "4 -> 3 experts, top-2" in printed and "Relative reconstruction error" in printed
    assert cli(["shrink", moe_dir, str(tmp_path / "loss"), "--keep", "2", "--method", "loss", "--data", calib,
                "--search-candidates", "2"]) == 0
    assert "Calibration loss (nats per token): full model" in capsys.readouterr().out


def test_the_cli_offers_every_method_and_each_is_one_class_by_its_name():
    """`hf-moe shrink --method` names its choices in hf_moe_cli.py (so that --help imports no torch); they are the
    registry's, and each name finds the class that carries it."""
    import hf_moe_cli
    from hf_moe.shrink import METHODS
    from hf_moe.shrink.methods import SHRINK_METHODS, ShrinkMethod

    shrink = next(a for a in hf_moe_cli._parser()._actions if a.choices and "shrink" in a.choices).choices["shrink"]
    assert next(a for a in shrink._actions if a.dest == "method").choices == list(METHODS) == list(SHRINK_METHODS)
    assert all(issubclass(c, ShrinkMethod) and c.name == name for name, c in SHRINK_METHODS.items())


# ------------------------------------------------------------------------------------------------ errors
def test_bad_input_is_refused_with_what_to_do(moe_dir, calib, tmp_path, capsys):
    for keep in (0, 5):
        with pytest.raises(ShrinkError, match=f"keep must be an integer from 1 to the model's 4 experts.*got {keep}"):
            hf_moe.shrink(moe_dir, tmp_path / "out", keep, "frequency", calib, progress=False)
    short = tmp_path / "short.txt"
    short.write_text("just a few words")
    with pytest.raises(ShrinkError, match="gives 16 tokens; shrinking needs at least 256"):
        hf_moe.shrink(moe_dir, tmp_path / "out", 2, "reconstruction", short, progress=False)
    with pytest.raises(ShrinkError, match="needs calibration text"):
        hf_moe.shrink(moe_dir, tmp_path / "out", 2, "frequency", progress=False)
    dense = tmp_path / "dense"
    tiny_dense("llama").save_pretrained(dense)
    with pytest.raises(ShrinkError, match="not a Mixture-of-Experts model.*hf-moe convert"):
        hf_moe.shrink(dense, tmp_path / "out", 2, "frequency", calib, progress=False)
    with pytest.raises(ShrinkError, match="method='loss' chooses each layer's experts.*scope='global'"):
        hf_moe.shrink(moe_dir, tmp_path / "out", 2, "loss", calib, scope="global", progress=False)
    with pytest.raises(ShrinkError, match="search_candidates must be a positive integer, got 0"):
        hf_moe.shrink(moe_dir, tmp_path / "out", 2, "loss", calib, search_candidates=0, progress=False)
    assert not (tmp_path / "out").exists()  # nothing written on any refusal
    assert cli(["shrink", moe_dir, str(tmp_path / "out"), "--keep", "0", "--data", calib]) == 2
    assert "hf-moe shrink: error: keep must be an integer from 1" in capsys.readouterr().err


# ------------------------------------------------------------------------------- methods on a designed case
def _config(num_experts: int = 4):
    base = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       vocab_size=VOCAB)
    return MoEConfig.from_base(base, num_experts=num_experts, num_experts_per_tok=1, moe_intermediate_size=12)


def _designed_layer(twin_noise: float = 0.0):
    """A 4-expert top-1 layer on 2048 tokens where expert 1 is expert 0 with its neurons permuted (plus
    `twin_noise` x N(0, 1) on its weights) and its router row nudged: the twins take about half the tokens, expert 2
    the other half, and expert 3 is rare but loud (10x outputs)."""
    torch.manual_seed(0)
    block = SparseMoeBlock(_config()).eval()
    perm = torch.randperm(12)
    with torch.no_grad():
        direction = torch.nn.functional.normalize(torch.randn(16), dim=0) * 4
        block.gate.weight.copy_(torch.stack([direction, direction + 0.01 * torch.randn(16), -direction,
                                             0.3 * torch.randn(16)]))
        experts = block.experts
        experts.down_proj[3] *= 10
        params = {n: getattr(experts, n).detach().clone() for n in ("gate_up_proj", "down_proj")}
        for name, tensor in permuted(params, 0, perm, glu=True).items():
            getattr(experts, name)[1] = tensor + twin_noise * tensor.std() * torch.randn_like(tensor)
    x = torch.randn(2048, 16)
    index, weights, logits = route(block.gate, x)
    params = {n: getattr(experts, n).detach().float() for n in ("gate_up_proj", "down_proj")}
    outputs = expert_outputs(experts, params, x)
    data = LayerData(x, logits, index, weights, outputs, combine(outputs, index, weights))
    return block, data, params, perm


def test_reconstruction_drops_a_duplicate_where_frequency_drops_a_rare_expert_that_matters():
    block, data, _, _ = _designed_layer()
    counts, _ = data.usage()
    assert counts[3] < 0.1 * counts.sum() and min(counts[0], counts[1]) > 0.1 * counts.sum()
    rec = Reconstruction(block, data, router_state(block), lambda m: _config(m))
    best = rec.best(3)
    assert len({0, 1} & set(best.kept)) == 1 and {2, 3} <= set(best.kept)  # one twin goes, the rest stays
    assert best.error < 1e-6
    frequent = frequency_subset(data.usage(), 3)
    assert frequent == [0, 1, 2]  # the rare, loud expert 3 goes
    assert rec.error(frequent) > 0.1


def test_merge_aligns_a_permuted_twin_groups_it_with_its_twin_and_beats_pruning():
    block, data, params, perm = _designed_layer(twin_noise=0.3)
    found = match_neurons(neuron_features(params, 0, True), neuron_features(params, 1, True))
    assert torch.equal(found, perm.argsort())  # expert 1's neurons lined up with expert 0's, despite the noise
    rec = Reconstruction(block, data, router_state(block), lambda m: _config(m))
    centres = rec.best(3).kept
    twin = ({0, 1} - set(centres)).pop()
    groups = groups_for(centres, logit_correlation(data.logits))
    assert groups[({0, 1} - {twin}).pop()] == [twin] and sum(map(len, groups.values())) == 1
    choice, state, kept = merge_layer(rec, block.experts, params, centres, groups, sigmoid=False)
    assert choice.kept == centres and choice.groups == {({0, 1} - {twin}).pop(): [twin]}
    assert choice.error < 0.8 * rec.error(centres)  # the merge reconstructs better than dropping the twin
    assert kept["gate_up_proj"].shape[0] == 3 and state["weight"].shape == (3, 16)


def test_merge_is_never_worse_than_reconstruction_on_the_calibration_text(moe_dir, calib, tmp_path):
    rec = hf_moe.shrink(moe_dir, tmp_path / "r", 2, "reconstruction", calib, progress=False)
    merged = hf_moe.shrink(moe_dir, tmp_path / "m", 2, "merge", calib, progress=False)
    first = min(rec.layers)  # the first layer sees the same input under both
    assert merged.layers[first].error <= rec.layers[first].error + 1e-9
    assert merged.layers[first].kept == rec.layers[first].kept


def _calibration_loss(model, calib, tokenizer) -> float:
    from hf_moe.shrink.calibration import calibration_ids, min_tokens

    ids = calibration_ids(calib, tokenizer, 4096, 256, min_tokens(4, 2))
    logits = _logits(model, ids)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hf_moe", *sorted(NATIVE)])
def test_the_loss_search_reports_the_loss_of_what_it_writes_and_beats_reconstruction_there(calib, tmp_path, kind):
    """Method loss: each layer keeps one of reconstruction's best subsets, by the model's calibration loss with the
    layers before it replayed from the best evaluation so far. The loss it reports for reconstruction's choice and
    for its own is that of the checkpoints written (a stale replay would report a model never written). The hf_moe
    model ties its output head to the input embedding, as SmolLM2 does: the head is not on disk."""
    if kind == "hf_moe":
        torch.manual_seed(0)
        model = hf_moe.convert_to_moe(tiny_dense("llama", tie_word_embeddings=True), num_experts=4, top_k=2, noise=0.2)
        source = str(tmp_path / "tied")
        model.save_pretrained(source)
        tiny_tokenizer().save_pretrained(source)
    else:
        source = _native_dir(tmp_path, kind)
    load = MoEForCausalLM.from_pretrained if kind == "hf_moe" else AutoModelForCausalLM.from_pretrained
    tokenizer = tiny_tokenizer()
    rec = hf_moe.shrink(source, tmp_path / "rec", 2, "reconstruction", calib, progress=False)
    found = hf_moe.shrink(source, tmp_path / "loss", 2, "loss", calib, search_candidates=6, progress=False)
    search = found.search
    assert search.evaluations == 2 + 5 * len(found.layers)  # the full model, reconstruction's choice, 5 more a layer
    assert search.reconstruction_loss == pytest.approx(_calibration_loss(load(tmp_path / "rec"), calib, tokenizer),
                                                       abs=1e-5)
    assert search.loss == pytest.approx(_calibration_loss(load(tmp_path / "loss"), calib, tokenizer), abs=1e-5)
    assert search.full_loss == pytest.approx(_calibration_loss(load(source), calib, tokenizer), abs=1e-5)
    changed = [i for i in found.layers if found.layers[i].kept != rec.layers[i].kept]
    assert changed and search.loss < search.reconstruction_loss - 1e-4  # the search moved, and for the better
    assert json.loads((tmp_path / "loss" / "shrink.json").read_text())["calibration_loss"]["kept"] == round(search.loss, 6)


def test_ranked_subsets_come_from_enumeration_or_from_greedy_eliminations_last_step(monkeypatch):
    from hf_moe.shrink import select

    block, data, _, _ = _designed_layer()
    rec = Reconstruction(block, data, router_state(block), lambda m: _config(m))
    enumerated = rec.ranked(2, 4)
    errors = [c.error for c in enumerated]
    assert len(enumerated) == 4 and errors == sorted(errors) and enumerated[0].kept == rec.best(2).kept
    assert all(c.error == pytest.approx(rec.error(c.kept)) for c in enumerated)
    monkeypatch.setattr(select, "ENUMERATION_LIMIT", 1)  # as for 64 or 128 experts
    greedy = rec.ranked(2, 3)
    assert len(greedy) == 3 and len({tuple(c.kept) for c in greedy}) == 3 and greedy[0].kept == rec.best(2).kept
    left = set().union(*(c.kept for c in greedy))  # the 3 experts left before the last drop, each less one
    assert len(left) == 3 and all(len(c.kept) == 2 and len(left - set(c.kept)) == 1 for c in greedy)
    assert [c.error for c in greedy] == sorted(c.error for c in greedy)
    assert rec.ranked(4, 3)[0].kept == [0, 1, 2, 3]


def test_each_layer_aims_at_the_original_model_not_at_its_own_shrunk_input(moe_dir, calib, tmp_path, monkeypatch):
    """Reconstruction said a later layer's choice corrects the error of the layers shrunk before it, but aimed each
    layer at the full block's output on the shrunk model's input, which takes that error as given. The target is now
    the original model's output at the layer (carried in the same forward), and the search runs on the shrunk input."""
    from hf_moe.shrink import methods
    from hf_moe.shrink.calibration import calibration_ids

    seen = {}
    choose = methods.ReconstructionMethod.choose

    def spy(self, layer, block, data, state, params):
        seen[layer] = (data.x.clone(), data.routed.clone())
        return choose(self, layer, block, data, state, params)

    monkeypatch.setattr(methods.ReconstructionMethod, "choose", spy)
    hf_moe.shrink(moe_dir, tmp_path / "out", 2, "reconstruction", calib, calibration_tokens=256, progress=False)
    model = MoEForCausalLM.from_pretrained(moe_dir).eval()
    ids = calibration_ids(calib, tiny_tokenizer(), 256, 256, 1)
    inputs, outputs = {}, {}

    def record(i):
        def hook(module, args, out):
            inputs[i], outputs[i] = args[0].reshape(-1, args[0].shape[-1]), out.reshape(-1, out.shape[-1])
        return hook

    for i, layer in enumerate(model.model.layers):  # the original model's blocks (no shared experts: routed output)
        layer.mlp.register_forward_hook(record(i))
    with torch.no_grad():
        model(ids)
    assert len(seen) == 3
    for i, (x, target) in seen.items():
        torch.testing.assert_close(target, outputs[i], rtol=1e-4, atol=1e-5)
        assert i == 0 or not torch.allclose(x, inputs[i], rtol=1e-3, atol=1e-4)  # searched on the shrunk input


# ------------------------------------------------------------------------------------------ dynamic skipping
def test_dynamic_skipping_is_off_by_default_and_threshold_one_is_top_1(moe_dir):
    assert MoEConfig.from_base(tiny_dense("llama").config, num_experts=4).router_skip_threshold == 0.0
    ids = random_ids()
    skipping = MoEForCausalLM.from_pretrained(moe_dir, router_skip_threshold=1.0)
    top1 = MoEForCausalLM.from_pretrained(moe_dir, num_experts_per_tok=1)
    assert torch.equal(_logits(skipping, ids), _logits(top1, ids))  # only the top expert, renormalised to 1
    full = MoEForCausalLM.from_pretrained(moe_dir)
    assert not torch.equal(_logits(full, ids), _logits(top1, ids))
    off = MoEForCausalLM.from_pretrained(moe_dir, router_skip_threshold=0.0)
    assert torch.equal(_logits(off, ids), _logits(full, ids))
    with pytest.raises(ValueError, match=r"router_skip_threshold must be in \[0, 1\]"):
        MoEConfig.from_base(tiny_dense("llama").config, num_experts=4, router_skip_threshold=1.5)


@pytest.mark.compile
@pytest.mark.slow
def test_dynamic_skipping_marks_small_weights_in_eval_only_and_traces_in_one_graph(moe_dir):
    model = MoEForCausalLM.from_pretrained(moe_dir, router_skip_threshold=0.9)
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(64, model.config.hidden_size)
    out = gate.eval()(x)
    skipped = out.top_k_index[:, 1] == -1
    assert skipped.any() and not skipped.all()
    torch.testing.assert_close(out.top_k_weights.sum(-1), torch.ones(64))
    assert (out.top_k_weights[skipped, 1] == 0).all()
    assert (gate.train()(x).top_k_index >= 0).all()  # training routes as usual
    block = model.model.layers[0].mlp.eval()
    compiled = torch.compile(block, backend="eager", fullgraph=True)  # no graph break, no data-dependent branch
    torch.testing.assert_close(compiled(x.unsqueeze(0)), block(x.unsqueeze(0)))


def test_native_export_refuses_a_model_that_skips_experts():
    from hf_moe.export import export_problems

    config = MoEConfig.from_base(tiny_dense("llama").config, num_experts=4, decoder_layers_path="model.layers")
    assert export_problems(config) == []
    config.router_skip_threshold = 0.2
    assert export_problems(config) == [
        "router_skip_threshold=0.2: native MoE models compute every chosen expert (no dynamic skipping). Set "
        "config.router_skip_threshold=0 (an inference option) and export again."]


def test_a_classifier_checkpoint_stays_a_classifier(calib, tmp_path):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    dense = AutoModelForSequenceClassification.from_config(tiny_dense("llama", num_labels=3).config).eval()
    model = hf_moe.convert_to_moe(dense, num_experts=4, top_k=2, noise=0.2)
    model.save_pretrained(tmp_path / "cls")
    tiny_tokenizer().save_pretrained(tmp_path / "cls")
    hf_moe.shrink(tmp_path / "cls", tmp_path / "out", 4, "reconstruction", calib, progress=False)
    shrunk = hf_moe.MoEForSequenceClassification.from_pretrained(tmp_path / "out")
    assert shrunk.config.architectures == ["MoELlamaForSequenceClassification"]
    ids = random_ids()
    assert torch.equal(_logits(shrunk, ids), _logits(model, ids))
    with pytest.raises(ShrinkError, match="next-token loss of a causal LM.*MoEForSequenceClassification"):
        hf_moe.shrink(tmp_path / "cls", tmp_path / "out2", 2, "loss", calib, progress=False)


@pytest.mark.slow
def test_an_aux_free_router_keeps_its_saved_bias(calib, tmp_path):
    """The selection bias is a buffer, not a parameter: it is read from the checkpoint, used, and cut with the rows."""
    torch.manual_seed(0)
    model = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, noise=0.2, router_type="aux_free")
    for layer in model.model.layers:
        layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.1, -0.4]))
    model.save_pretrained(tmp_path / "src")
    tiny_tokenizer().save_pretrained(tmp_path / "src")
    hf_moe.shrink(tmp_path / "src", tmp_path / "all", 4, "reconstruction", calib, progress=False)
    ids = random_ids()
    assert torch.equal(_logits(MoEForCausalLM.from_pretrained(tmp_path / "all"), ids), _logits(model, ids))
    result = hf_moe.shrink(tmp_path / "src", tmp_path / "two", 2, "reconstruction", calib, progress=False)
    shrunk = MoEForCausalLM.from_pretrained(tmp_path / "two")
    kept = result.layers[0].kept
    assert torch.equal(shrunk.model.layers[0].mlp.gate.e_score_correction_bias,
                       torch.tensor([0.3, -0.2, 0.1, -0.4])[kept])


def test_a_native_checkpoint_missing_an_expert_is_refused(tmp_path, calib):
    from safetensors.torch import load_file, save_file

    source = _native_dir(tmp_path, "mixtral")
    tensors = load_file(f"{source}/model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, f"{source}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ShrinkError, match="no tensor model.layers.1.block_sparse_moe.experts.3.w2.weight"):
        hf_moe.shrink(source, tmp_path / "out", 2, "random", progress=False)


# ---------------------------------------------------------------------------------------------------- benchmark
@pytest.mark.subprocess
@pytest.mark.slow
def test_shrink_benchmark_smoke_run(tmp_path):
    """benchmarks/shrink.py --smoke (tiny random models): every method shrinks and is evaluated, skipping is measured,
    the native Mixtral round trip keeps its logits, and the tables say whether the goals hold."""
    import os

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "shrink.py")
    done = subprocess.run([sys.executable, script, "--smoke", "--workdir", str(tmp_path), "--keeps", "4,2", "--seeds",
                           "0,1", "--no-speed", "--thresholds", "1.0"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_MOE_BACKEND": "torch"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "shrink.md").read_text()
    assert "| 4 | " in report and "| 2 | " in report and "random (2 seeds" in report
    assert "Reconstruction below frequency and every random seed at" in report and "the 2% goal" in report
    assert "| 1.0 | 50.0% |" in report  # top-2 with threshold 1: one chosen expert of two skipped
    assert "| 8 | MixtralForCausalLM | 8 | 0.00e+00 |" in report
