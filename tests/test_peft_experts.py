"""PEFT's LoRA on fused 3-D expert weights (`target_parameters`) running on hf_moe's experts.

On an hf_moe model and on transformers' Mixtral and Qwen3-MoE loaded with `experts_implementation="hf_moe"`: a LoRA on
`mlp.experts.gate_up_proj` and `mlp.experts.down_proj` trains (its gradients reach every expert's A and B), runs on
hf_moe's experts function (PEFT parametrizes the weight for the forward, and hf_moe reads it through the module's
attribute), saves, reloads onto a freshly loaded base with equal logits, and `merge_and_unload()` gives the model that
the same LoRA merged by hand gives (W_e + s B_e A_e for every expert e, on the default experts), which saves and
reloads with equal logits.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_dense
from transformers import AutoConfig, AutoModelForCausalLM

from hf_moe import MoEForCausalLM, convert_to_moe
from hf_moe.compat import ALL_EXPERTS_FUNCTIONS
from hf_moe.ops import experts_interface

peft = pytest.importorskip("peft")

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
NATIVE = {
    "mixtral": dict(num_local_experts=4, intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True),
}


def _native(model_type: str, implementation: str, path=None):
    if path is not None:
        return AutoModelForCausalLM.from_pretrained(path, experts_implementation=implementation).eval()
    config = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, num_experts_per_tok=2, **NATIVE[model_type])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, experts_implementation=implementation).eval()


def _load(kind: str, path, implementation: str = "hf_moe"):
    """The saved base of `kind`, loaded fresh: hf_moe's own model, or a native one on `implementation`'s experts."""
    return MoEForCausalLM.from_pretrained(path).eval() if kind == "hf_moe" else _native(kind, implementation, path)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _hand_merged(model, wrappers: dict) -> None:
    """W_e += s B_e A_e in `model` for each LoRA of `wrappers` ({parameter path: PEFT's ParamWrapper}), from its A
    [E r, in] and B [out, E r] as PEFT lays them out (expert-major rows of A, expert-minor columns of B)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for path, wrapper in wrappers.items():
            weight = params[path]
            e = weight.shape[0]
            a = wrapper.lora_A["default"].weight.reshape(e, -1, weight.shape[2])  # [E, r, in]
            b = wrapper.lora_B["default"].weight.reshape(weight.shape[1], -1, e).permute(2, 0, 1)  # [E, out, r]
            weight += wrapper.scaling["default"] * torch.bmm(b, a)


def _wrappers(peft_model) -> dict:
    """{path of the expert parameter in the base model: its ParamWrapper}."""
    from peft.tuners.lora.layer import ParamWrapper

    found = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, ParamWrapper):
            owner = name.removeprefix("base_model.model.").replace(".base_layer", "")
            found[f"{owner}.{module.parameter_name}"] = module
    return found


@pytest.fixture
def count_calls():
    calls = []
    real = ALL_EXPERTS_FUNCTIONS[experts_interface.NAME]
    ALL_EXPERTS_FUNCTIONS.register(experts_interface.NAME, lambda self, *a: calls.append(1) or real(self, *a))
    try:
        yield calls
    finally:
        ALL_EXPERTS_FUNCTIONS.register(experts_interface.NAME, real)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hf_moe", "mixtral", "qwen3_moe"])
def test_lora_on_fused_experts_trains_saves_reloads_and_merges_as_by_hand(kind, count_calls, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    if kind == "hf_moe":
        torch.manual_seed(0)
        convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, noise=0.05).save_pretrained(tmp_path / "base")
    else:
        _native(kind, "hf_moe").save_pretrained(tmp_path / "base")
    base = _load(kind, tmp_path / "base")
    ids = torch.randint(3, 96, (4, 12), generator=torch.Generator().manual_seed(0))
    base_logits = _logits(base, ids)

    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_parameters=TARGETS))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    layers = base.config.num_hidden_layers
    assert len(trainable) == 2 * 2 * layers and all(".experts." in n and "lora_" in n for n in trainable)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 1:  # (B starts at zero: from the second step on, A gets gradients too)
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    count_calls.clear()
    adapted = _logits(model, ids)
    assert kind == "hf_moe" or len(count_calls) == layers  # a native model's experts ran on hf_moe's function
    assert (adapted - base_logits).abs().max() > 1e-3  # the LoRA moved the logits

    model.save_pretrained(tmp_path / "lora")
    reloaded = PeftModel.from_pretrained(_load(kind, tmp_path / "base"), tmp_path / "lora").eval()
    torch.testing.assert_close(_logits(reloaded, ids), adapted, rtol=0, atol=0)

    by_hand = _load(kind, tmp_path / "base", implementation="eager")  # (natives: transformers' own experts)
    _hand_merged(by_hand, _wrappers(reloaded))
    merged = reloaded.merge_and_unload()
    assert type(merged) is type(base)
    hand_params = dict(by_hand.named_parameters())
    for name, param in merged.named_parameters():
        torch.testing.assert_close(param, hand_params[name], rtol=1e-6, atol=1e-7, msg=name)
    merged_logits = _logits(merged, ids)
    torch.testing.assert_close(merged_logits, _logits(by_hand, ids), rtol=1e-5, atol=1e-6)
    # W x + s B (A x) against (W + s B A) x: the same function summed in another order
    torch.testing.assert_close(merged_logits, adapted, rtol=1e-5, atol=1e-5)

    merged.save_pretrained(tmp_path / "merged")
    torch.testing.assert_close(_logits(_load(kind, tmp_path / "merged"), ids), merged_logits, rtol=0, atol=0)
