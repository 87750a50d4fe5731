"""MoEForCausalLM: the base architecture plus MoE blocks; its config; its outputs and losses."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import random_ids, tiny_config, tiny_dense
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from hf_moe import MoEConfig, MoEForCausalLM, SparseMoeBlock, convert_to_moe, load_balancing_loss

pytestmark = pytest.mark.oldest


def _moe(family="llama", **kwargs):
    return convert_to_moe(tiny_dense(family), num_experts=4, top_k=2, **kwargs)


# -- config --------------------------------------------------------------------------------------------------------
def test_config_keeps_base_fields_and_adds_moe_fields_with_transformers_names():
    config = _moe().config
    assert MoEConfig.model_type == "hf_moe" and config.model_type == "hf_moe"
    assert isinstance(config, MoEConfig) and isinstance(config, LlamaConfig)
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) == (64, 2, 16)
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (4, 2, True)
    assert config.router_aux_loss_coef == 0.01 and config.output_router_logits is False
    assert config.moe_layers == [0, 1, 2] and config.moe_intermediate_size == 96
    d = config.to_dict()
    assert d["model_type"] == "hf_moe" and d["base_model_type"] == "llama"


def test_config_keeps_the_base_attribute_map():
    config = _moe("gpt2").config
    assert isinstance(config, GPT2Config)
    assert config.hidden_size == config.n_embd == 64 and config.num_hidden_layers == 3


def test_config_round_trips_through_json_and_pickle(tmp_path):
    config = _moe("phi3").config
    config.save_pretrained(tmp_path)
    for loaded in (AutoConfig.from_pretrained(tmp_path), MoEConfig.from_pretrained(tmp_path),
                   pickle.loads(pickle.dumps(config))):
        assert type(loaded) is type(config)
        ignore = {"transformers_version": None, "_name_or_path": None}
        assert loaded.to_dict() | ignore == config.to_dict() | ignore


def test_config_from_base_and_back():
    base = tiny_config("llama")
    config = MoEConfig.from_base(base, num_experts=8, num_experts_per_tok=2)
    assert config.moe_intermediate_size == 96
    assert type(config.to_base_config()) is LlamaConfig
    assert config.to_base_config().hidden_size == 64


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(num_experts=4, num_experts_per_tok=5), "between 1 and num_experts=4"),
        (dict(num_experts=0), "at least 1"),
        (dict(moe_layers=[5]), r"moe_layers \[5\] are out of range"),
        (dict(hf_moe_format=99), "newer hf_moe"),
    ],
)
def test_config_validation(fields, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig.from_base(tiny_config("llama"), **fields)


def test_config_needs_a_base_type():
    with pytest.raises(ValueError, match="base_model_type"):
        MoEConfig(num_experts=4)


# -- model class ---------------------------------------------------------------------------------------------------
def test_model_is_the_base_class_with_moe_blocks():
    moe = _moe()
    assert isinstance(moe, MoEForCausalLM) and isinstance(moe, LlamaForCausalLM)
    assert type(moe).__name__ == "MoELlamaForCausalLM"
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in moe.model.layers)


def test_from_config_builds_the_same_architecture():
    config = _moe("gpt_neox").config
    for model in (MoEForCausalLM(config), AutoModelForCausalLM.from_config(config),
                  MoEForCausalLM._from_config(config)):
        assert type(model).__name__ == "MoEGPTNeoXForCausalLM"
        out = model(random_ids(), labels=random_ids())
        assert torch.isfinite(out.loss)
        block = model.gpt_neox.layers[0].mlp
        assert block.gate.weight.std() > 0 and block.experts.up_proj.std() > 0  # initialised, not empty


def test_moe_config_needed():
    with pytest.raises(TypeError, match="needs an MoEConfig"):
        MoEForCausalLM(tiny_config("llama"))


def test_model_pickles():
    moe = _moe()
    clone = pickle.loads(pickle.dumps(moe))
    ids = random_ids()
    with torch.no_grad():
        torch.testing.assert_close(clone(ids).logits, moe(ids).logits)


# -- outputs and losses --------------------------------------------------------------------------------------------
def test_block_is_a_drop_in_for_the_mlp():
    moe = _moe()
    block = moe.model.layers[0].mlp
    for shape in [(2, 5, 64), (7, 64), (1, 1, 64)]:
        assert block(torch.randn(shape)).shape == shape


def test_training_loss_is_lm_loss_plus_coef_times_aux_loss():
    moe = _moe()
    moe.config.router_aux_loss_coef = 0.5
    ids = random_ids()
    moe.train()
    out = moe(ids, labels=ids)
    assert isinstance(out, MoeCausalLMOutputWithPast)
    lm_loss = moe.loss_function(out.logits, ids, vocab_size=moe.config.vocab_size)
    torch.testing.assert_close(out.loss, lm_loss + 0.5 * out.aux_loss)
    assert out.aux_loss.dtype == torch.float32 and out.aux_loss > 0
    out.loss.backward()
    assert moe.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_eval_loss_is_the_lm_loss_alone():
    moe = _moe().eval()
    ids = random_ids()
    out = moe(ids, labels=ids)
    lm_loss = moe.loss_function(out.logits, ids, vocab_size=moe.config.vocab_size)
    torch.testing.assert_close(out.loss, lm_loss)
    assert out.aux_loss is not None


def test_router_logits_are_returned_on_request():
    moe = _moe().eval()
    ids = random_ids(2, 5)
    assert moe(ids).router_logits is None
    out = moe(ids, output_router_logits=True)
    assert len(out.router_logits) == 3
    assert all(r.shape == (10, 4) and r.dtype == torch.float32 for r in out.router_logits)
    moe.config.output_router_logits = True
    assert len(moe(ids).router_logits) == 3


def test_aux_loss_matches_definition_and_ignores_padding():
    moe = _moe().eval()
    ids = random_ids(2, 6)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = moe(ids, attention_mask=mask, output_router_logits=True)
    keep = mask.reshape(-1).bool()
    expected = []
    for logits in out.router_logits:
        probs = logits.softmax(-1)[keep]
        top = probs.topk(2, dim=-1).indices
        fraction = torch.bincount(top.reshape(-1), minlength=4).float() / top.shape[0]  # per token: sums to k
        expected.append(4 * (fraction * probs.mean(0)).sum())
    torch.testing.assert_close(out.aux_loss, torch.stack(expected).mean())


def test_return_dict_false_gives_a_tuple():
    moe = _moe().eval()
    ids = random_ids()
    out = moe(ids, labels=ids, return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], moe(ids, labels=ids).loss)


def test_positional_arguments_are_accepted():
    moe = _moe("gpt2").eval()
    ids = random_ids()
    with torch.no_grad():
        torch.testing.assert_close(moe(ids, None, torch.ones_like(ids)).logits, moe(input_ids=ids).logits)


def test_aux_loss_weight_follows_num_items_in_batch():
    """With Trainer's num_items_in_batch, each micro-batch's aux loss is weighted by its share of label tokens."""
    moe = _moe().train()
    moe.config.router_aux_loss_coef = 1.0
    ids = random_ids(2, 9)
    plain = moe(ids, labels=ids)
    scaled = moe(ids, labels=ids, num_items_in_batch=torch.tensor(64))
    share = 2 * 8 / 64
    lm = moe.loss_function(plain.logits, ids, vocab_size=moe.config.vocab_size, num_items_in_batch=torch.tensor(64))
    torch.testing.assert_close(scaled.loss, lm + share * scaled.aux_loss)


def test_loss_function_unit_cases():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    # Uniform routing over E experts balances perfectly: loss k, transformers' scale (Mixtral's
    # load_balancing_loss_func gives the same, so TRL's trainers weigh it as Trainer does).
    probs = torch.full((8, 4), 0.25)
    index = torch.tensor([[0, 1], [2, 3]] * 4)
    torch.testing.assert_close(load_balancing_loss(probs, index, 4), torch.tensor(2.0))
    logits = torch.randn(8, 4)
    torch.testing.assert_close(
        load_balancing_loss(logits.softmax(-1), logits.topk(2).indices, 4), load_balancing_loss_func((logits,), 4, 2)
    )
    # Everything on expert 0 with all probability there: loss E.
    probs = torch.tensor([[1.0, 0, 0, 0]]).expand(8, 4)
    index = torch.zeros(8, 1, dtype=torch.long)
    torch.testing.assert_close(load_balancing_loss(probs, index, 4), torch.tensor(4.0))
    # Slots a router chose not to send (-1) count for nothing.
    index = torch.tensor([[0, -1]] * 8)
    torch.testing.assert_close(load_balancing_loss(probs, index, 4), torch.tensor(4.0))
    index = torch.tensor([[0, 1]] * 8)
    torch.testing.assert_close(load_balancing_loss(probs, index, 4), torch.tensor(4.0))


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = random_ids()
    grads = []
    for checkpointing in (False, True):
        moe = _moe().train()
        if checkpointing:
            moe.gradient_checkpointing_enable()
        moe(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in moe.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)
    assert grads[1]["model.layers.0.mlp.gate.weight"].abs().sum() > 0  # the router learns from the aux loss


def test_reentrant_checkpointing_warns_that_routers_get_no_aux_gradient():
    moe = _moe().train()
    moe.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = random_ids()
    with pytest.warns(UserWarning, match="load-balancing loss has no gradient"):
        moe(ids, labels=ids)


def test_device_map_and_dtype_on_load(tmp_path):
    moe = _moe()
    moe.save_pretrained(tmp_path)
    for device_map in ("cpu", "auto", {"": "cpu"}):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map, dtype=torch.bfloat16)
        assert isinstance(loaded, MoEForCausalLM)
        assert loaded.dtype == torch.bfloat16 and loaded.device.type == "cpu"
