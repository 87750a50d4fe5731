"""`hf_moe.export_native`: the export loads in plain transformers (hf_moe never imported) with the same logits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import SPECIAL_IDS, VOCAB, random_ids, tiny_dense
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

import hf_moe
from hf_moe import NativeExportError, export_native

# Loads every exported folder in a fresh interpreter that imports transformers, never hf_moe.
PLAIN_TRANSFORMERS = """
import json, sys, torch
from transformers import AutoModelForCausalLM
dirs, ids = json.loads(sys.argv[1]), torch.load(sys.argv[2])
out = {}
for name, path in dirs.items():
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out[name] = (type(model).__name__, model.config.model_type, model.dtype == torch.float32, model(ids).logits)
assert "hf_moe" not in sys.modules, "hf_moe was imported"
torch.save(out, sys.argv[3])
"""
IDS = random_ids(batch=2, length=16, seed=3)  # longer than mistral's sliding window (6)


def tiny_olmo2():
    """Olmo2 is not among conftest's families: a tiny one built the same way (GQA, post-norms, q/k norms)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "olmo2", vocab_size=VOCAB, **SPECIAL_IDS, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


# case -> (dense model factory, convert_to_moe kwargs, native architecture, a native per-expert key on disk)
CASES = {
    # rope scaling and tied embeddings must be carried into Mixtral's config
    "llama": (
        lambda: tiny_dense("llama", tie_word_embeddings=True,
                           rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}),
        {}, "MixtralForCausalLM", "model.layers.0.block_sparse_moe.experts.3.w1.weight",
    ),
    "mistral": (lambda: tiny_dense("mistral"), {}, "MixtralForCausalLM",
                "model.layers.2.block_sparse_moe.experts.0.w3.weight"),
    # head_dim (32) differs from hidden_size / heads (16): Qwen3-MoE must be told
    "qwen3": (lambda: tiny_dense("qwen3", head_dim=32), {}, "Qwen3MoeForCausalLM",
              "model.layers.1.mlp.experts.2.gate_proj.weight"),
    "qwen3_partial": (lambda: tiny_dense("qwen3", head_dim=32), {"layers": [0, 2]}, "Qwen3MoeForCausalLM",
                      "model.layers.1.mlp.gate_proj.weight"),
    "olmo2": (tiny_olmo2, {}, "FlexOlmoForCausalLM", "model.layers.0.mlp.experts.1.up_proj.weight"),
}


def _convert(case: str):
    make, kwargs, _, _ = CASES[case]
    return hf_moe.convert_to_moe(make(), num_experts=4, top_k=2, noise=0.01, **kwargs).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every case converted, exported, and run by plain transformers in one fresh interpreter.

    Returns {case: (moe_logits, plain-transformers output, NativeExport, export dir)}.
    """
    root = tmp_path_factory.mktemp("export")
    models, results = {}, {}
    for case in CASES:
        models[case] = _convert(case)
        results[case] = export_native(models[case], root / case)
    torch.save(IDS, root / "ids.pt")
    dirs = {case: str(root / case) for case in CASES}
    subprocess.run(
        [sys.executable, "-c", PLAIN_TRANSFORMERS, json.dumps(dirs), str(root / "ids.pt"), str(root / "out.pt")],
        check=True, cwd=root,
    )
    plain = torch.load(root / "out.pt")
    out = {}
    for case, moe in models.items():
        with torch.no_grad():
            out[case] = (moe(IDS).logits, plain[case], results[case], root / case)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_plain_transformers_with_equal_logits(exported, case):
    moe_logits, (architecture, _, is_fp32, logits), result, _ = exported[case]
    assert architecture == CASES[case][2] == result.architecture and is_fp32
    diff = (logits - moe_logits).abs().max().item()
    print(f"{case}: max |logit difference| {diff:.2e}")
    torch.testing.assert_close(logits, moe_logits, rtol=0, atol=1e-5)
    assert result.max_abs_logit_diff is not None and result.max_abs_logit_diff < 1e-5 and result.same_argmax


@pytest.mark.parametrize("case", list(CASES))
def test_files_are_in_the_native_layout(exported, case):
    path = exported[case][3]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [CASES[case][2]] and "moe_conversion" not in config
    keys = set()
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            keys.update(f.keys())
    assert CASES[case][3] in keys
    assert not any("gate_up_proj" in k for k in keys)  # transformers' own per-expert names, not hf_moe's fused ones
    assert (path / "generation_config.json").is_file()


def test_carried_config_fields(exported):
    config = lambda case: json.loads((exported[case][3] / "config.json").read_text())  # noqa: E731
    assert config("mistral")["sliding_window"] == 6 and config("llama")["sliding_window"] is None
    assert config("llama")["rope_parameters"]["factor"] == 2.0 and config("llama")["tie_word_embeddings"] is True
    assert config("qwen3")["head_dim"] == 32 and config("qwen3")["mlp_only_layers"] == []
    assert config("qwen3_partial")["mlp_only_layers"] == [1] and config("qwen3_partial")["norm_topk_prob"] is True
    assert config("llama")["router_aux_loss_coef"] == 0.01 and config("llama")["router_jitter_noise"] == 0.0


def test_model_card(exported):
    card = (exported["qwen3_partial"][3] / "README.md").read_text()
    diff = exported["qwen3_partial"][2].max_abs_logit_diff
    assert f"at most {diff:.2e} on a random probe" in card and "greedy tokens equal" in card
    assert "`Qwen3MoeForCausalLM`" in card and "no hf_moe import" in card and "from_pretrained" in card
    assert "2 of 3: 0, 2; dense MLP in 1" in card and "4 per MoE layer, top-2" in card
    assert "active per token" in card and "`upcycle` (noise=0.01)" in card
    assert "\nlicense:" not in card  # unknown for a model built from a config: not invented
    assert "{" not in card.split("```python")[0]  # every field filled


def test_test_is_sensitive_to_expert_and_gate_up_order():
    """The noise makes the experts differ, so a wrong expert order or a swapped gate/up would change the logits."""
    moe = _convert("llama")
    experts = moe.model.layers[0].mlp.experts
    with torch.no_grad():
        reference = moe(IDS).logits
        i = experts.intermediate_dim
        gate_up = experts.gate_up_proj.clone()
        experts.gate_up_proj.copy_(torch.cat([gate_up[:, i:], gate_up[:, :i]], dim=1))
        assert (moe(IDS).logits - reference).abs().max() > 1e-3
        experts.gate_up_proj.copy_(gate_up.flip(0))
        assert (moe(IDS).logits - reference).abs().max() > 1e-4


# --------------------------------------------------------------------------------------------------------------
# What does not fit
# --------------------------------------------------------------------------------------------------------------
def _error(moe, tmp_path) -> str:
    with pytest.raises(NativeExportError) as info:
        export_native(moe, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written
    return str(info.value)


def test_family_without_a_native_target_lists_every_reason(tmp_path):
    moe = hf_moe.convert_to_moe(tiny_dense("gpt2"), num_experts=4, top_k=2)
    message = _error(moe, tmp_path)
    assert "`gpt2` has no native transformers MoE architecture" in message
    assert "llama -> mixtral" in message and "qwen3 -> qwen3_moe" in message
    assert "expert_glu=False" in message and "expert_hidden_act='gelu_new'" in message and "expert_bias=True" in message


def test_qwen2_is_not_offered_because_of_the_shared_expert(tmp_path):
    message = _error(hf_moe.convert_to_moe(tiny_dense("qwen2"), num_experts=4, top_k=2), tmp_path)
    assert "`qwen2` has no native" in message and "shared expert" in message


def test_router_and_capacity_that_do_not_fit(tmp_path):
    moe = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=1, router_type="switch")
    message = _error(moe, tmp_path)
    assert "router_type='switch'" in message and "router_type='topk'" in message
    assert "capacity_factor=1.25" in message and "eval_capacity_factor=2.0" in message and "dropless" in message


def test_capacity_on_the_topk_router_does_not_fit(tmp_path):
    moe = hf_moe.convert_to_moe(tiny_dense("qwen3"), num_experts=4, top_k=2, capacity_factor=2.0)
    message = _error(moe, tmp_path)
    assert "capacity_factor=2.0" in message and "router_type" not in message


def test_mixtral_needs_every_layer_moe_and_renormalised_weights(tmp_path):
    moe = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, layers=[0], norm_topk_prob=False)
    message = _error(moe, tmp_path)
    assert "MoE in layers [0] of 3: mixtral has an MoE block in every layer" in message
    assert "norm_topk_prob=False: mixtral always renormalises" in message


def test_qwen3_with_mixed_sliding_and_full_attention_does_not_fit(tmp_path):
    dense = tiny_dense("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    message = _error(hf_moe.convert_to_moe(dense, num_experts=4, top_k=2), tmp_path)
    assert "mixes sliding (4) and full attention" in message


def test_qwen3_without_renormalisation_exports(tmp_path):
    """Qwen3-MoE's norm_topk_prob is a config field, so raw softmax weights fit (unlike Mixtral)."""
    moe = hf_moe.convert_to_moe(tiny_dense("qwen3"), num_experts=4, top_k=2, noise=0.01, norm_topk_prob=False)
    result = export_native(moe, tmp_path / "out")
    assert result.max_abs_logit_diff < 1e-5
    assert json.loads((tmp_path / "out" / "config.json").read_text())["norm_topk_prob"] is False


def test_split_with_shared_experts_and_unit_weights_does_not_fit(tmp_path):
    """A split model weights its experts by 1 and keeps an always-active shared expert: neither has a native twin."""
    moe = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=3, top_k=2, method="split", num_shared_experts=1)
    message = _error(moe, tmp_path)
    assert "router_weights='unit'" in message and "num_shared_experts=1" in message
    assert "mixtral" in message and "qwen2_moe's is sigmoid-gated" in message


def test_split_with_softmax_weights_exports(tmp_path):
    """Split experts are ordinary SiLU-GLU experts: with softmax weights the model exports, equal to the hf_moe one."""
    moe = hf_moe.convert_to_moe(tiny_dense("qwen3"), num_experts=4, top_k=2, method="split",
                                router_weights="softmax").eval()
    result = export_native(moe, tmp_path / "out")
    assert result.architecture == "Qwen3MoeForCausalLM" and result.max_abs_logit_diff < 1e-5


def test_metadata_the_gguf_loader_adds_is_carried_not_refused(tmp_path):
    """transformers' GGUF loader adds `_model_name_or_path` and `unk_token_id` to a Llama config (the quickstart's
    SmolLM2 has both). Neither changes what the model computes, so export carries them instead of refusing."""
    dense = tiny_dense("llama")
    dense.save_pretrained(tmp_path / "dense")
    config_path = tmp_path / "dense" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(_model_name_or_path="/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf", unk_token_id=0)
    config_path.write_text(json.dumps(config))
    moe = hf_moe.convert_to_moe(str(tmp_path / "dense"), num_experts=4, top_k=2)
    moe.save_pretrained(tmp_path / "moe")
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["unk_token_id"] == 0
    export_native(str(tmp_path / "moe"), tmp_path / "native")
    exported = json.loads((tmp_path / "native" / "config.json").read_text())
    assert exported["model_type"] == "mixtral" and exported["unk_token_id"] == 0
