"""The other heads: sequence classification (reward models) and token classification over an MoE backbone, the
backbone alone (`AutoModel`), and expert ranges given to the constructor (no global state while building)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
)

import hf_moe
from conftest import random_ids, tiny_config, tiny_dense, tiny_tokenizer


def _dense(auto_class, family="llama", seed=0, **overrides):
    torch.manual_seed(seed)
    return auto_class.from_config(tiny_config(family, **overrides)).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_a_reward_model_converts_exactly_and_keeps_its_head(family, tmp_path):
    dense = _dense(AutoModelForSequenceClassification, family, num_labels=1)
    ids = random_ids()
    want = dense(ids).logits
    moe = hf_moe.convert_to_moe(dense, num_experts=4, top_k=2)
    assert isinstance(moe, hf_moe.MoEForSequenceClassification) and isinstance(moe, type(dense))
    torch.testing.assert_close(moe(ids).logits, want, rtol=0, atol=1e-5)
    assert torch.equal(moe.score.weight, dense.score.weight)

    moe.save_pretrained(tmp_path / "rm")
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["architectures"] == [type(moe).__name__]
    assert "auto_map" not in config  # (it loads after `import hf_moe`: test_tokenizer_without_hf_moe.py)
    for loader in (AutoModelForSequenceClassification, hf_moe.MoEForSequenceClassification):
        loaded = loader.from_pretrained(tmp_path / "rm")
        assert type(loaded) is type(moe)
        assert torch.equal(loaded(ids).logits, moe(ids).logits)


def test_a_token_classifier_converts_exactly():
    dense = _dense(AutoModelForTokenClassification, num_labels=3)
    ids = random_ids()
    moe = hf_moe.convert_to_moe(dense, num_experts=4, top_k=2)
    assert isinstance(moe, hf_moe.MoEForTokenClassification)
    torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=0, atol=1e-5)


def test_a_causal_lm_checkpoint_loads_as_a_classifier_with_a_new_head(tmp_path):
    """As in transformers: the backbone's weights load, the new head is initialised (and said to be); a checkpoint
    whose backbone lacks tensors is still refused."""
    lm = hf_moe.convert_to_moe(tiny_dense(), num_experts=4, top_k=2)
    lm.save_pretrained(tmp_path / "lm")
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=2)
    assert isinstance(classifier, hf_moe.MoEForSequenceClassification)
    ids = random_ids()
    torch.testing.assert_close(classifier.model(ids).last_hidden_state, lm.model(ids).last_hidden_state)


def test_without_labels_the_routers_losses_reach_the_gradient_through_the_logits():
    """A trainer that computes its loss from the logits alone (TRL's RewardTrainer) still trains the routers to
    balance: the routers' losses ride on the logits into the backward (Megatron's MoEAuxLossAutoScaler)."""
    dense = _dense(AutoModelForSequenceClassification, num_labels=1)
    moe = hf_moe.convert_to_moe(dense, num_experts=4, top_k=2).train()
    ids = random_ids()
    grads = {}
    for coef in (0.0, 1.0):
        moe.zero_grad()
        moe.config.router_aux_loss_coef = coef
        out = moe(ids)
        assert out.aux_loss is not None and out.aux_loss.requires_grad
        out.logits.sum().backward()
        grads[coef] = moe.model.layers[0].mlp.gate.weight.grad.clone()
    # The logits alone give the router a gradient too (through the routing weights); the aux loss adds its own.
    moe.zero_grad()
    moe.config.router_aux_loss_coef = 1.0
    out = moe(ids)
    out.aux_loss.backward()
    aux_grad = moe.model.layers[0].mlp.gate.weight.grad
    torch.testing.assert_close(grads[1.0] - grads[0.0], aux_grad, rtol=1e-4, atol=1e-6)


def test_with_labels_the_routers_losses_join_the_heads_loss():
    dense = _dense(AutoModelForSequenceClassification, num_labels=3)
    moe = hf_moe.convert_to_moe(dense, num_experts=4, top_k=2).train()
    ids, labels = random_ids(), torch.tensor([0, 2])
    out = moe(ids, labels=labels)
    moe.config.router_aux_loss_coef = 0.0
    plain = moe(ids, labels=labels)
    torch.testing.assert_close(out.loss - plain.loss, 0.01 * out.aux_loss, rtol=1e-4, atol=1e-7)


def test_the_backbone_alone_loads_with_its_experts(tmp_path):
    lm = hf_moe.convert_to_moe(tiny_dense(), num_experts=4, top_k=2)
    lm.save_pretrained(tmp_path / "lm")
    backbone = AutoModel.from_pretrained(tmp_path / "lm")
    assert isinstance(backbone.layers[0].mlp, hf_moe.SparseMoeBlock)
    ids = random_ids()
    out = backbone(ids, output_router_logits=True)
    assert torch.equal(out.last_hidden_state, lm.model(ids).last_hidden_state)
    assert len(out.router_logits) == len(lm.config.moe_layers)


def test_a_corrupt_checkpoint_is_refused_by_every_head(tmp_path):
    lm = hf_moe.convert_to_moe(tiny_dense(), num_experts=4, top_k=2)
    lm.save_pretrained(tmp_path / "lm")
    expert = tmp_path / "lm" / "model-expert-00001.safetensors"
    data = bytearray(expert.read_bytes())
    data[-3] ^= 0xFF
    expert.write_bytes(bytes(data))
    for loader in (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModel):
        with pytest.raises(hf_moe.CheckpointError, match="model-expert-00001"):
            loader.from_pretrained(tmp_path / "lm")


def test_a_head_transformers_lacks_is_refused_with_the_family_named():
    config = hf_moe.MoEConfig.from_base(
        tiny_config("opt"), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96
    )
    with pytest.raises(ValueError, match="no TokenClassification class for model type 'opt'"):
        hf_moe.MoEForTokenClassification(config)


def test_experts_are_built_for_the_range_they_are_given():
    """Expert parallelism builds each process's block through the constructor (`expert_range`), not through state
    set around it."""
    config = hf_moe.MoEConfig.from_base(tiny_config("llama"), num_experts=4, num_experts_per_tok=2)
    model = hf_moe.MoEForCausalLM(config, expert_range=(2, 4))
    experts = model.model.layers[0].mlp.experts
    assert (experts.num_local_experts, experts.expert_offset, experts.gate_up_proj.shape[0]) == (2, 2, 2)
    assert hf_moe.MoEForCausalLM(config).model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
    with pytest.raises(ValueError, match="expert_range"):
        hf_moe.MoEForCausalLM(config, expert_range=(3, 9))


@pytest.mark.slow
def test_trl_reward_trainer_trains_an_moe_reward_model(tmp_path):
    """TRL's RewardTrainer, unpatched, a few steps on chosen / rejected pairs: the loss falls and the routers move
    under the balancing loss."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    dense = _dense(AutoModelForSequenceClassification, num_labels=1, pad_token_id=0)
    moe = hf_moe.convert_to_moe(dense, num_experts=4, top_k=2)
    tokenizer = tiny_tokenizer()
    pairs = [("the sky is blue.", "the sky is made of cheese."), ("cats sleep a lot.", "cats are metal.")] * 8
    data = Dataset.from_dict({"chosen": [c for c, _ in pairs], "rejected": [r for _, r in pairs]})
    router_before = moe.model.layers[0].mlp.gate.weight.detach().clone()
    args = trl.RewardConfig(
        output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=4, learning_rate=5e-3,
        logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no", max_length=32,
    )
    trainer = trl.RewardTrainer(model=moe, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert not torch.equal(moe.model.layers[0].mlp.gate.weight.detach(), router_before)
