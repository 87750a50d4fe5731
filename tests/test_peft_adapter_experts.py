"""PEFT around adapter experts: a LoRA on the attention of a model whose experts are adapters on a frozen MLP.

`get_peft_model` trains, saves, reloads onto a freshly loaded checkpoint, `merge_and_unload()` and `unload()` work
(PEFT recognises its own tuner layers by a `base_layer` attribute, which the adapter experts do not have);
`modules_to_save=["gate"]` trains and saves the routers with the LoRA; `modules_to_save` naming the adapter experts is
refused with the reason. The frozen MLP's former name (`base_layer`) still loads, and the base fingerprints recorded
under it still match.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_ids, tiny_dense

from hf_moe import MoEForCausalLM, convert_to_moe
from hf_moe.checkpoint.adapter_experts import base_fingerprint
from hf_moe.layers.adapter_experts import AdapterExperts

peft = pytest.importorskip("peft")

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def adapter_checkpoint(tmp_path_factory):
    """A saved adapter-experts model (lora method, 4 experts, top-2, non-zero adapters) on a saved dense base."""
    root = tmp_path_factory.mktemp("peft_adapter_experts")
    tiny_dense("llama").save_pretrained(root / "dense")
    torch.manual_seed(0)
    moe = convert_to_moe(root / "dense", num_experts=4, top_k=2, method="lora", rank=4)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if name.endswith("_lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    moe.save_pretrained(root / "moe")
    return root / "moe"


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _train(model, ids, steps: int = 3) -> None:
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("routers", [False, True], ids=["attention", "attention+routers"])
def test_peft_lora_around_adapter_experts_end_to_end(adapter_checkpoint, routers, tmp_path):
    """Train, save, reload (equal logits), merge_and_unload (an MoE model with its adapter experts, equal to the adapted
    model to fp32 rounding), unload (the checkpoint's own weights, exactly). With modules_to_save=["gate"] the routers
    train and travel with the LoRA (and unload keeps them, as PEFT does for modules_to_save); the MoE's own adapters
    stay as loaded (PEFT freezes what it does not add)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    ids = random_ids(4, 16)
    base = MoEForCausalLM.from_pretrained(adapter_checkpoint)
    base_logits = _logits(base, ids)
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    extra = dict(modules_to_save=["gate"]) if routers else {}
    model = get_peft_model(base, LoraConfig(**LORA, **extra))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n or (routers and ".gate.modules_to_save." in n) for n in trainable)
    assert any(".gate." in n for n in trainable) == routers
    _train(model, ids)
    adapted = _logits(model, ids)
    assert (adapted - base_logits).abs().max() > 1e-3  # the LoRA (and routers) learned something

    model.save_pretrained(tmp_path / "lora")
    reloaded = PeftModel.from_pretrained(MoEForCausalLM.from_pretrained(adapter_checkpoint), tmp_path / "lora").eval()
    torch.testing.assert_close(_logits(reloaded, ids), adapted, rtol=0, atol=0)

    merged = reloaded.merge_and_unload()
    assert isinstance(merged, MoEForCausalLM)
    assert not any(hasattr(m, "base_layer") or hasattr(m, "original_module") for m in merged.modules())
    assert sum(isinstance(m, AdapterExperts) for m in merged.modules()) == 3
    # W x + B (A x) against (W + B A) x: the same function summed in another order (the LoRA moved logits by > 1e-3)
    torch.testing.assert_close(_logits(merged, ids), adapted, rtol=1e-5, atol=1e-5)
    changed = {n for n, p in merged.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("q_proj" in n or "v_proj" in n or (routers and ".gate." in n) for n in changed)

    again = PeftModel.from_pretrained(MoEForCausalLM.from_pretrained(adapter_checkpoint), tmp_path / "lora")
    unloaded = again.unload().eval()
    assert isinstance(unloaded, MoEForCausalLM)
    if not routers:
        torch.testing.assert_close(_logits(unloaded, ids), base_logits, rtol=0, atol=0)
    merged_state = merged.state_dict()
    for name, p in unloaded.named_parameters():  # PEFT's unload keeps what modules_to_save trained, drops the LoRA
        torch.testing.assert_close(p, merged_state[name] if ".gate." in name else before[name], rtol=0, atol=0)


@pytest.mark.slow
def test_modules_to_save_on_adapter_experts_is_refused(adapter_checkpoint):
    """PEFT would copy each experts module whole, the frozen dense MLP included, and train and save that copy."""
    from peft import LoraConfig, get_peft_model

    base = MoEForCausalLM.from_pretrained(adapter_checkpoint)
    with pytest.raises(ValueError, match=r"modules_to_save names the adapter experts .*frozen dense MLP.*\"gate\""):
        get_peft_model(base, LoraConfig(**LORA, modules_to_save=["gate", "experts"]))


def test_the_frozen_mlp_under_its_former_name_loads():
    """A state dict that names the frozen MLP `experts.base_layer.*` (a checkpoint written before the rename, in which
    the user had unfrozen it; Trainer's resume loads those with load_state_dict) loads into it."""
    moe = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method="lora", rank=4, verify=False)
    state = {k.replace(".experts.dense_mlp.", ".experts.base_layer."): torch.full_like(v, 0.5)
             for k, v in moe.state_dict().items() if ".experts.dense_mlp." in k}
    assert len(state) == 9  # gate, up, down in each of 3 layers
    result = moe.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert all(bool((p == 0.5).all()) for n, p in moe.named_parameters() if ".experts.dense_mlp." in n)


def test_base_fingerprints_recorded_under_the_former_name_still_match():
    """The fingerprint hashes the frozen MLP's keys under the name they had when fingerprints were first recorded
    (`experts.base_layer.*`): the structure hash of this model is the one the code before the rename computed."""
    moe = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method="lora", rank=4, verify=False)
    found = base_fingerprint(moe)
    assert found["structure"] == "xxh3_128:6b74ea8de02ae21dd6552f9589ecd32c"
    assert found["tensors"] == 30


@pytest.mark.slow
def test_a_merged_lora_is_saved_with_the_model(adapter_checkpoint, tmp_path):
    """merge_and_unload() changes frozen weights (q_proj, v_proj) that an adapter-expert checkpoint takes from its base:
    save_pretrained wrote only the routers and adapters, and the reload computed the model without the LoRA. A save
    now compares each frozen tensor with the base's and writes those that differ (q_proj and v_proj, nothing else of
    the base): the reload has equal logits, and what trains is what trains on the original checkpoint (the routers
    and adapters): the merged weights stay frozen."""
    from peft import LoraConfig, get_peft_model

    ids = random_ids(2, 12)
    base = MoEForCausalLM.from_pretrained(adapter_checkpoint)
    base_logits = _logits(base, ids)
    trainable = {n for n, p in base.named_parameters() if p.requires_grad}  # (get_peft_model freezes them)
    assert trainable and not any("q_proj" in n or "v_proj" in n for n in trainable)
    merged = get_peft_model(base, LoraConfig(**LORA, init_lora_weights=False)).merge_and_unload().eval()
    expected = _logits(merged, ids)
    assert (expected - base_logits).abs().max() > 1e-3  # the merged LoRA changes the output
    merged.save_pretrained(tmp_path / "merged")
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["frozen"] == sorted(k for k in index["weight_map"] if "q_proj" in k or "v_proj" in k)
    assert len(index["metadata"]["frozen"]) == 6  # (q_proj and v_proj of 3 layers)
    reloaded = MoEForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(_logits(reloaded, ids), expected, rtol=0, atol=0)
    assert {n for n, p in reloaded.named_parameters() if p.requires_grad} == trainable
    # On its untouched base, a model still saves only what trained; loaded in another dtype too (the base as cast)
    for dtype in (None, torch.bfloat16):
        MoEForCausalLM.from_pretrained(adapter_checkpoint, dtype=dtype).save_pretrained(tmp_path / "untouched")
        saved = json.loads((tmp_path / "untouched" / "model.safetensors.index.json").read_text())
        assert "frozen" not in saved["metadata"] and not any("q_proj" in k for k in saved["weight_map"])
