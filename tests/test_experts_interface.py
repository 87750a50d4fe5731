"""experts_implementation="hf_moe" on transformers' own MoE models, against their eager implementation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_moe  # noqa: F401  (registers "hf_moe" in transformers' ExpertsInterface)
from hf_moe.ops import experts_interface, use_backend
from hf_moe.ops.extension import load_extension

pytestmark = pytest.mark.oldest

NATIVE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                      head_dim=16),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=48),
}


def _model(model_type, implementation, seed=0):
    config = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, **NATIVE[model_type])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=implementation)
    return model.eval()


@pytest.mark.parametrize("backend", ["compiled", "torch"])
@pytest.mark.parametrize("model_type", sorted(NATIVE))
def test_native_model_on_hf_moe_experts_matches_eager(model_type, backend, monkeypatch):
    if backend == "compiled" and load_extension()[0] is None:
        pytest.skip(f"the compiled backend is unavailable: {load_extension()[1].how}")
    calls = []
    real = experts_interface.experts_forward
    monkeypatch.setattr(experts_interface, "experts_forward", lambda *a: calls.append(1) or real(*a))
    eager, ours = _model(model_type, "eager"), _model(model_type, "hf_moe")
    assert ours.config._experts_implementation == "hf_moe"
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    with use_backend(backend):
        out = ours(ids, labels=ids)
        out.loss.backward()
    ref = eager(ids, labels=ids)
    ref.loss.backward()
    assert calls, "the hf_moe experts function was not used"
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    ref_grads = dict(eager.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_generation_matches_eager():
    eager, ours = _model("qwen3_moe", "eager"), _model("qwen3_moe", "hf_moe")
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))


def test_layouts_we_do_not_take_go_to_grouped_mm():
    model = _model("mixtral", "hf_moe")
    experts = model.model.layers[0].mlp.experts
    assert experts_interface._supported(experts)
    experts.is_transposed = True
    assert not experts_interface._supported(experts)
