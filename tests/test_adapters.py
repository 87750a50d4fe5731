"""A LoRA adapter trained on the dense model, on its MoE conversion: carried over exactly, or refused loudly.

`hf_moe.convert_adapter` puts the dense MLPs' LoRA deltas on the experts (PEFT's `target_parameters` on the fused
tensors) and on the shared experts; the logits then equal dense + adapter. A plain `PeftModel.from_pretrained`
of the dense adapter drops the MLP part: it must warn and name the modules.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import random_ids, tiny_dense

import hf_moe

peft = pytest.importorskip("peft")
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model  # noqa: E402

from hf_moe.convert.lora import AdapterConversionError, convert_adapter  # noqa: E402

IDS = random_ids(batch=2, length=12, seed=5)
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # the MLP's gate and up fused in one Linear
    "opt": ["q_proj", "v_proj", "fc1", "fc2"],  # the MLP written inline in the decoder layer
    "gpt2": ["mlp.c_fc", "mlp.c_proj"],  # Conv1D (fan_in_fan_out) and biases
}


def _dense_adapter(family: str, tmp_path, **lora):
    """A dense model with a random (nonzero) LoRA on attention and MLP, saved; and its logits on IDS."""
    config = dict(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=TARGETS[family], init_lora_weights=False)
    config.update(fan_in_fan_out=family == "gpt2", **lora)
    torch.manual_seed(1)
    adapted = get_peft_model(tiny_dense(family), LoraConfig(**config)).eval()
    with torch.no_grad():
        logits = adapted(IDS).logits
        with adapted.disable_adapter():
            effect = (adapted(IDS).logits - logits).abs().max().item()
    assert effect > 0.05, "the adapter must change the logits, or the test could not fail"
    adapted.save_pretrained(tmp_path / "dense-adapter")
    return tmp_path / "dense-adapter", logits


def _convert(family: str, method: str = "upcycle", **options):
    top_k = options.pop("top_k", 2)
    return hf_moe.convert_to_moe(tiny_dense(family), num_experts=4 if not options.get("num_shared_experts") else 3,
                                 top_k=top_k, method=method, **options).eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _assert_equal_up_to_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but for fp32 rounding, which grows with the logits: within 1e-5 of the largest (as docs/converting.md
    checks; SmolLM2, with logits up to 30-40, differs by about 1e-4, a few 1e-6 of them)."""
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


CASES = {
    "upcycle": ("llama", "upcycle", {}),
    "upcycle-shared": ("llama", "upcycle", {"num_shared_experts": 1}),
    "split": ("llama", "split", {"top_k": 4}),  # every expert chosen: the split is exact
    "split-shared": ("llama", "split", {"top_k": 3, "num_shared_experts": 1}),
    "fused-gate-up": ("phi3", "upcycle", {}),
    "inline-mlp": ("opt", "upcycle", {}),
    "conv1d": ("gpt2", "split", {"top_k": 4}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_converted_adapter_equals_dense_plus_adapter(case, tmp_path):
    family, method, options = CASES[case]
    adapter, expected = _dense_adapter(family, tmp_path, use_rslora=case == "split")
    moe = _convert(family, method, **options)
    base = tiny_dense(family) if method == "split" else None
    converted = convert_adapter(adapter, moe, base_model=base).eval()
    assert isinstance(converted, PeftModel)
    got = _logits(converted)
    diff = (got - expected).abs().max().item()
    print(f"{case}: max |logit difference| to dense + adapter {diff:.2e}, {diff / expected.abs().max():.1e} of the logits")
    _assert_equal_up_to_rounding(got, expected)


def test_converted_adapter_saves_reloads_and_merges(tmp_path):
    adapter, expected = _dense_adapter("llama", tmp_path)
    converted = convert_adapter(adapter, _convert("llama", num_shared_experts=1)).eval()
    converted.save_pretrained(tmp_path / "moe-adapter")
    reloaded = PeftModel.from_pretrained(_convert("llama", num_shared_experts=1), tmp_path / "moe-adapter").eval()
    _assert_equal_up_to_rounding(_logits(reloaded), expected)
    merged = reloaded.merge_and_unload()
    assert isinstance(merged, hf_moe.MoEForCausalLM)
    _assert_equal_up_to_rounding(_logits(merged), expected)


def test_adapter_as_a_peft_model_and_on_some_layers(tmp_path):
    """A PeftModel object converts like its saved directory; an adapter on some layers and a model with some MoE
    layers keep the dense MLPs' LoRA where the MLP stayed dense."""
    torch.manual_seed(2)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj", "up_proj", "down_proj"], init_lora_weights=False,
                        layers_to_transform=[1, 2])
    adapted = get_peft_model(tiny_dense("llama"), config).eval()
    expected = _logits(adapted)
    moe = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, layers=[0, 1]).eval()
    converted = convert_adapter(adapted, moe).eval()
    _assert_equal_up_to_rounding(_logits(converted), expected)
    wrapped = {n for n, _ in converted.named_modules()}
    assert "base_model.model.model.layers.2.mlp.up_proj.lora_A" in wrapped  # layer 2 stayed dense


# --------------------------------------------------------------------------------------------------------------
# Refused loudly
# --------------------------------------------------------------------------------------------------------------
def test_split_without_the_dense_model_is_refused(tmp_path):
    adapter, _ = _dense_adapter("llama", tmp_path)
    with pytest.raises(AdapterConversionError, match="pass base_model="):
        convert_adapter(adapter, _convert("llama", "split", top_k=4))


def test_split_model_changed_since_conversion_is_refused(tmp_path):
    adapter, _ = _dense_adapter("llama", tmp_path)
    moe = _convert("llama", "split", top_k=4)
    with torch.no_grad():
        moe.model.layers[1].mlp.experts.down_proj[2, 0, 0] += 1e-3
    with pytest.raises(AdapterConversionError, match="In layer 1, expert 2 holds neurons that are not the dense"):
        convert_adapter(adapter, moe, base_model=tiny_dense("llama"))


@pytest.mark.parametrize(
    "family, lora, message",
    [
        ("llama", {"use_dora": True}, "DoRA"),
        ("gpt2", {"bias": "lora_only"}, "biases"),
        ("gpt2", {"target_modules": ["c_attn", "mlp.c_fc"]}, "Conv1D layers, which PEFT runs with fan_in_fan_out"),
    ],
)
def test_adapters_that_cannot_carry_over_exactly_are_refused(family, lora, message, tmp_path):
    adapter, _ = _dense_adapter(family, tmp_path, **lora)
    with pytest.raises(AdapterConversionError, match=message):
        convert_adapter(adapter, _convert(family))


def test_an_int8_moe_model_is_refused_with_what_to_do(tmp_path):
    """On int8 experts (frozen buffers) PEFT wrapped nothing, and convert_adapter called that a bug of its own."""
    adapter, _ = _dense_adapter("llama", tmp_path)
    with pytest.raises(AdapterConversionError, match="int8 experts .* frozen buffers.* floating-point MoE model"):
        convert_adapter(adapter, hf_moe.quantize_experts(_convert("llama")))


def test_other_peft_methods_are_refused(tmp_path):
    adapted = get_peft_model(tiny_dense("llama"), IA3Config(target_modules=["v_proj", "down_proj"],
                                                            feedforward_modules=["down_proj"]))
    with pytest.raises(AdapterConversionError, match="Only LoRA adapters carry over"):
        convert_adapter(adapted, _convert("llama"))


# --------------------------------------------------------------------------------------------------------------
# A plain PeftModel.from_pretrained warns
# --------------------------------------------------------------------------------------------------------------
def test_plain_peft_load_of_a_dense_adapter_warns_and_names_the_dropped_modules(tmp_path):
    adapter, expected = _dense_adapter("llama", tmp_path)
    moe = _convert("llama", layers=[0, 2])
    with pytest.warns(UserWarning, match="replaced with MoE blocks") as record:
        loaded = PeftModel.from_pretrained(moe, adapter).eval()
    (message,) = [str(w.message) for w in record if "MoE blocks" in str(w.message)]
    assert message.startswith("6 modules in the weights being loaded are dense MLP modules")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert f"base_model.model.model.layers.[0,2].mlp.{proj}" in message
    assert "hf_moe.convert_adapter" in message
    assert (_logits(loaded) - expected).abs().max() > 1e-2  # what the warning is about: the MLP part is missing


def test_adapter_trained_on_the_moe_model_reloads_without_the_warning(tmp_path):
    """LoRA on the shared experts (`mlp.shared_experts.gate_proj`, ...) and on the experts' tensors reloads with equal
    logits: PEFT's loader runs adapter keys through hf_moe's expert-stacking rules, which must leave these alone."""
    torch.manual_seed(3)
    config = LoraConfig(r=2, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"], init_lora_weights=False,
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    adapted = get_peft_model(_convert("llama", num_shared_experts=1), config).eval()
    assert "base_model.model.model.layers.0.mlp.shared_experts.gate_proj.lora_A" in dict(adapted.named_modules())
    expected = _logits(adapted)
    adapted.save_pretrained(tmp_path / "moe-adapter")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*replaced with MoE blocks.*")
        reloaded = PeftModel.from_pretrained(_convert("llama", num_shared_experts=1), tmp_path / "moe-adapter").eval()
    torch.testing.assert_close(_logits(reloaded), expected, rtol=0, atol=0)
