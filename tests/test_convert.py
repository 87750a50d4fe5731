"""Upcycling reproduces the dense model on every supported family; bad input gets a clear error."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, random_ids, tiny_config, tiny_dense
from transformers import AutoConfig, AutoModelForCausalLM

import hf_moe
from hf_moe import MoEForCausalLM, NoMLPFoundError, SparseMoeBlock, convert_to_moe
from hf_moe.routing import moe_blocks

pytestmark = pytest.mark.oldest

# Upcycled experts are identical and the top-k weights sum to one, so the MoE output is sum_j w_j * MLP(x).
# In fp32 that equals MLP(x) up to rounding of the weighted sum: a few ulps of the logits.
ATOL = 2e-5


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


def _generate(model, ids, attention_mask=None, n=10):
    return model.generate(
        input_ids=ids, attention_mask=attention_mask, max_new_tokens=n, do_sample=False, pad_token_id=0
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_upcycle_reproduces_dense_logits_and_greedy_tokens(family):
    dense = tiny_dense(family)
    ids = random_ids(2, 24)  # longer than Mistral's sliding window of 6
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in the second row
    ref = _logits(dense, ids, attention_mask=mask)
    ref_tokens = _generate(dense, ids[:, :8], mask[:, :8])

    moe = convert_to_moe(dense, num_experts=4, top_k=2)

    assert isinstance(moe, MoEForCausalLM)
    assert len(moe_blocks(moe)) == 3
    out = _logits(moe, ids, attention_mask=mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    assert torch.equal(_generate(moe, ids[:, :8], mask[:, :8]), ref_tokens)  # KV cache path
    assert moe.config.moe_conversion["max_abs_logit_diff"] < ATOL
    assert moe.config.moe_conversion["same_argmax"] is True


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_implementations_are_the_base_models(family, attn):
    dense = tiny_dense(family, attn_implementation=attn)
    ids = random_ids(2, 16)
    ref = _logits(dense, ids)
    moe = convert_to_moe(dense, num_experts=4, top_k=2)
    assert moe.config._attn_implementation == attn
    torch.testing.assert_close(_logits(moe, ids), ref, rtol=0, atol=ATOL)


def test_eager_and_sdpa_agree_after_conversion():
    moe = convert_to_moe(tiny_dense("qwen2"), num_experts=4, top_k=2)
    ids = random_ids(2, 16)
    sdpa = _logits(moe, ids)
    moe.set_attn_implementation("eager")
    torch.testing.assert_close(_logits(moe, ids), sdpa, rtol=1e-5, atol=1e-5)


def test_top1_and_full_topk_are_also_exact():
    for top_k in (1, 4):
        dense = tiny_dense("llama")
        ids = random_ids()
        ref = _logits(dense, ids)
        moe = convert_to_moe(dense, num_experts=4, top_k=top_k)
        torch.testing.assert_close(_logits(moe, ids), ref, rtol=0, atol=ATOL)


def test_experts_are_fused_3d_parameters_in_the_dense_dtype():
    dense = tiny_dense("gpt2").to(torch.bfloat16)
    moe = convert_to_moe(dense, num_experts=4, top_k=2)
    block = moe.transformer.h[0].mlp
    assert isinstance(block, SparseMoeBlock)
    params = dict(block.experts.named_parameters())
    assert set(params) == {"up_proj", "up_proj_bias", "down_proj", "down_proj_bias"}
    assert params["up_proj"].shape == (4, 256, 64) and params["down_proj"].shape == (4, 64, 256)
    assert all(p.dtype == torch.bfloat16 for p in moe.parameters())
    assert not any(isinstance(m, torch.nn.ModuleList) for m in block.modules())


def test_opt_inline_mlp_is_replaced_in_the_layer():
    moe = convert_to_moe(tiny_dense("opt"), num_experts=2, top_k=2)
    layer = moe.model.decoder.layers[0]
    assert isinstance(layer.fc1, SparseMoeBlock)
    assert isinstance(layer.fc2, torch.nn.Identity) and isinstance(layer.activation_fn, torch.nn.Identity)
    assert moe.config.moe_block_path == "fc1" and moe.config.moe_bypassed_paths == ["activation_fn", "fc2"]


def test_noise_and_seed():
    ids = random_ids()
    ref = _logits(tiny_dense(), ids)
    a = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, noise=0.1, seed=3)
    b = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, noise=0.1, seed=3)
    c = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, noise=0.1, seed=4)
    wa, wb, wc = (m.model.layers[0].mlp.experts.gate_up_proj for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert not torch.equal(wa[0], wa[1])  # copies differ
    assert (_logits(a, ids) - ref).abs().max() > ATOL
    assert a.config.moe_conversion["options"] == {"noise": 0.1, "seed": 3}


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(layers=[0, 2]), [0, 2]),
        (dict(layers=[-1]), [2]),
        (dict(every=2), [1]),  # as transformers' decoder_sparse_step: (i + 1) % every == 0
        (dict(every=1), [0, 1, 2]),
    ],
)
def test_layer_selection(kwargs, expected):
    dense = tiny_dense()
    ids = random_ids()
    ref = _logits(dense, ids)
    moe = convert_to_moe(dense, num_experts=4, top_k=2, **kwargs)
    assert moe.config.moe_layers == expected
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in moe.model.layers]
    assert kinds == [i in expected for i in range(3)]
    torch.testing.assert_close(_logits(moe, ids), ref, rtol=0, atol=ATOL)


def test_convert_from_a_saved_directory(tmp_path):
    dense = tiny_dense("qwen3")
    dense.save_pretrained(tmp_path / "dense")
    ids = random_ids()
    moe = convert_to_moe(tmp_path / "dense", num_experts=4, top_k=2, dtype="float32")
    assert moe.config.moe_conversion["base_model"] == str(tmp_path / "dense")
    torch.testing.assert_close(_logits(moe, ids), _logits(dense, ids), rtol=0, atol=ATOL)


def test_convert_in_bfloat16():
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, dtype="bfloat16")
    assert moe.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: logits of size ~1 agree to a few 1e-3 (greedy ties of a random model may flip).
    assert moe.config.moe_conversion["max_abs_logit_diff"] < 2e-2


# -- bad input ---------------------------------------------------------------------------------------------------
def test_missing_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_to_moe("/no/such/dir", num_experts=4, top_k=2)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert_to_moe(tmp_path, num_experts=4, top_k=2)


@pytest.mark.parametrize(
    "num_experts,top_k,match",
    [(4, 5, "top_k must be an int between 1 and num_experts=4"), (0, 1, "num_experts must be a positive int"),
     (4, 0, "top_k must be")],
)
def test_bad_counts(num_experts, top_k, match):
    with pytest.raises(ValueError, match=match):
        convert_to_moe(tiny_dense(), num_experts=num_experts, top_k=top_k)


@pytest.mark.parametrize("layers", [[3], [-4], [0, 7]])
def test_layer_out_of_range(layers):
    with pytest.raises(ValueError, match="out of range: the model has 3 decoder layers"):
        convert_to_moe(tiny_dense(), num_experts=4, top_k=2, layers=layers)


def test_layers_and_every_are_exclusive():
    with pytest.raises(ValueError, match="either `layers` or `every`"):
        convert_to_moe(tiny_dense(), num_experts=4, top_k=2, layers=[0], every=2)


def test_unknown_option():
    with pytest.raises(TypeError, match="unknown option.*nosie"):
        convert_to_moe(tiny_dense(), num_experts=4, top_k=2, nosie=0.1)


def test_encoder_only_model():
    config = AutoConfig.for_model("bert", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64)
    model = AutoModelForCausalLM.from_config(config)  # BertLMHeadModel: still an encoder
    with pytest.raises(ValueError, match="encoder-only"):
        convert_to_moe(model, num_experts=4, top_k=2)


def test_already_moe_model():
    config = AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
    with pytest.raises(ValueError, match="already a Mixture-of-Experts model"):
        convert_to_moe(AutoModelForCausalLM.from_config(config), num_experts=4, top_k=2)


def test_base_model_without_lm_head():
    from transformers import AutoModel

    with pytest.raises(ValueError, match="Pass the causal LM"):
        convert_to_moe(AutoModel.from_config(tiny_config("llama")), num_experts=4, top_k=2)


def test_model_without_a_findable_mlp_names_what_it_found():
    dense = tiny_dense()
    for layer in dense.model.layers:  # a feed-forward with two hidden layers: neither act(x W_up) W_down nor a GLU
        layer.mlp = torch.nn.Sequential(
            torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 96), torch.nn.SiLU(), torch.nn.Linear(96, 64)
        )
    with pytest.raises(NoMLPFoundError, match=r"Could not find an MLP.*mlp \(Sequential\)"):
        convert_to_moe(dense, num_experts=4, top_k=2)


def test_mlp_that_does_more_than_an_mlp_is_refused():
    dense = tiny_dense()
    for layer in dense.model.layers:
        forward = layer.mlp.forward
        layer.mlp.forward = lambda x, f=forward: 2 * f(x)  # something our experts would not reproduce
    with pytest.raises(NoMLPFoundError, match="could not reproduce its output"):
        convert_to_moe(dense, num_experts=4, top_k=2)


def test_converting_twice_is_refused():
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="already an hf_moe model"):
        hf_moe.convert_to_moe(moe, num_experts=4, top_k=2)


def test_conversion_check_runs_where_the_chosen_backend_cannot():
    """First light on the H100 died in gpu_check's training step: HF_MOE_BACKEND=triton (meant for CUDA)
    and a model converted on CPU, whose logit check ran the experts on Triton, which cannot run on CPU tensors without
    the interpreter. The check measures the conversion's weights, on the reference ops, wherever the model is."""
    from hf_moe.ops import use_backend
    from hf_moe.ops.triton import status

    if status("cpu")[0]:
        pytest.skip("Triton runs on CPU tensors here (TRITON_INTERPRET=1): nothing to refuse")
    dense = tiny_dense("llama")
    with use_backend("triton"):  # what HF_MOE_BACKEND=triton selects
        moe = convert_to_moe(dense, num_experts=4, top_k=2)
    assert moe.config.moe_conversion["max_abs_logit_diff"] < ATOL
