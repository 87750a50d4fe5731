"""Exact sparse upcycling on every decoder-only family transformers ships that hf_moe can convert.

Upcycling copies the dense MLP into every expert; with renormalised top-k weights the MoE block computes
sum_j w_j * MLP(x) = MLP(x), so the converted model must give the dense model's logits to fp32 rounding and the
same greedy tokens, with the KV cache and a left-padded batch. Each family is built tiny from its config (no hub).
The families that cannot be converted exactly are at the end, with the error each must get.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import SPECIAL_IDS, VOCAB, random_ids
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM
from transformers.activations import ACT2FN

from hf_moe import MoEForCausalLM, NoMLPFoundError, convert_to_moe
from hf_moe.dense_mlp import activation_name
from hf_moe.ops import _KERNEL_NAMES
from hf_moe.ops.reference import KERNEL_ACTIVATIONS
from hf_moe.routing import moe_blocks

pytestmark = pytest.mark.oldest

ATOL = 2e-5  # as in test_convert: a few ulps of the logits
LAYERS = 2

_D = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
          max_position_embeddings=64)
_HD = dict(_D, head_dim=16)
_SWA = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])  # window < the 24-token probe
_GPT2 = dict(n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64, n_inner=96)
_MLA = dict(_D, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16)

# test id ("model_type" or "model_type/variant") -> tiny config kwargs. The comment says what the family exercises.
FAMILIES = {
    # Llama-style SwiGLU (gate_proj/up_proj/down_proj)
    "llama": _D,  # the baseline: RMSNorm, RoPE, GQA
    "mistral": dict(_D, sliding_window=6),  # sliding-window attention on every layer
    "ministral": dict(_HD, **_SWA),  # sliding and full layers
    "qwen2": _D,  # q/k/v biases
    "qwen3": _HD,  # q/k norms
    "olmo": _D,  # non-parametric LayerNorm
    "olmo2": _D,  # norms after attention and MLP, q/k norms
    "olmo3": dict(_D, **_SWA),  # olmo2 with sliding-window layers
    "olmo_hybrid": _D,  # a linear-attention layer and a full-attention layer
    "stablelm": _D,  # partial rotary, LayerNorm
    "stablelm/parallel": dict(_D, use_parallel_residual=True),  # attention and MLP in parallel
    "granite": dict(_D, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.5, logits_scaling=2.0),
    "granite_swa": dict(_D, **_SWA),  # granite with sliding-window layers
    "helium": _HD,
    "smollm3": _D,  # NoPE on some layers
    "exaone4": dict(_D, **_SWA),  # norms after attention and MLP, sliding layers
    "seed_oss": _HD,
    "internlm3": _HD,
    "hunyuan_v1_dense": _HD,  # q/k norms
    "ernie4_5": _D,
    "diffllama": _D,  # differential attention
    "cwm": dict(_D, **_SWA),
    "minicpm3": _MLA,  # multi-head latent attention, muP embedding and residual scaling
    "youtu": _MLA,  # multi-head latent attention
    "cohere": _D,  # attention and MLP in parallel off one LayerNorm, logit scale
    "cohere2": dict(_D, **_SWA),  # cohere with sliding-window layers
    "lfm2": dict(_D, layer_types=["conv", "full_attention"]),  # a short-convolution layer; F.silu called in forward
    # GeGLU (tanh GELU)
    "gemma": _HD,
    "gemma2": dict(_HD, **_SWA),  # sliding layers, attention and final logit soft-capping, sandwich norms
    "gemma3_text": dict(_HD, **_SWA),  # sliding/global layers with two RoPE bases, q/k norms
    "gemma3n_text": dict(_HD, layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                         num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0], altup_num_inputs=2,
                         laurel_rank=8, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB),  # AltUp, LAuReL
    "gemma4_text": dict(_HD, **_SWA),
    "vaultgemma": dict(_HD, **_SWA),
    "modernbert-decoder": dict(_D, cls_token_id=3, sep_token_id=4, sliding_window=8),  # fused Wi/Wo, found by shape
    # Fused gate_up_proj
    "phi3": _D,
    "glm": _HD,  # partial rotary
    "glm4": _HD,  # sandwich norms
    # Plain MLPs: act(x W_up + b) W_down + b
    "gpt2": _GPT2,  # Conv1D projections (weights stored [in, out]), gelu_new
    "gpt_bigcode": _GPT2,  # multi-query attention, Linear c_fc/c_proj
    "openai-gpt": dict(_GPT2, afn="gelu"),  # post-LayerNorm GPT-1
    "gpt_neo": dict(hidden_size=64, num_layers=LAYERS, num_heads=4, intermediate_size=96, max_position_embeddings=64,
                    attention_types=[[["global", "local"], 1]], window_size=6),  # local attention layers
    "codegen": dict(_GPT2, n_ctx=64, rotary_dim=8),  # attention and MLP in parallel, fc_in/fc_out
    "gptj": dict(_GPT2, rotary_dim=8),  # attention and MLP in parallel, fc_in/fc_out
    "gpt_neox": _D,  # parallel residual, dense_h_to_4h/dense_4h_to_h
    "gpt_neox_japanese": _D,  # MLP without biases
    "falcon": dict(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4),  # parallel block, multi-query
    "falcon/new_decoder_architecture": dict(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                            num_kv_heads=2, new_decoder_architecture=True),  # two LayerNorms, GQA
    "falcon/alibi": dict(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, alibi=True),
    "bloom": dict(hidden_size=64, n_layer=LAYERS, n_head=4),  # ALiBi; the MLP adds the residual; BloomGelu
    "mpt": dict(d_model=64, n_heads=4, n_layers=LAYERS, expansion_ratio=2, max_seq_len=64),  # ALiBi; MLP adds residual
    "phi": _D,  # parallel block, partial rotary
    "starcoder2": _D,  # sliding window, biases, gelu_pytorch_tanh
    "persimmon": _D,  # ReLU^2 with biases, q/k LayerNorm
    "nemotron": _D,  # ReLU^2 up/down without gate, LayerNorm1P
    "arcee": _D,  # ReLU^2 up/down
    "jais2": _D,  # ReLU^2 with biases
    "nanochat": _D,  # ReLU^2, functional RMSNorm
    "ctrl": dict(n_embd=64, dff=96, n_layer=LAYERS, n_head=4, n_positions=64),  # nn.Sequential FFN, found by shape
    # MLP written in the decoder layer itself (fc1, activation_fn, fc2)
    "opt": dict(hidden_size=64, ffn_dim=96, num_hidden_layers=LAYERS, num_attention_heads=4, word_embed_proj_dim=64,
                max_position_embeddings=64),
    "xglm": dict(d_model=64, ffn_dim=96, num_layers=LAYERS, attention_heads=4, max_position_embeddings=64),
    "biogpt": _D,
    "trocr": dict(d_model=64, decoder_ffn_dim=96, decoder_layers=LAYERS, decoder_attention_heads=4,
                  max_position_embeddings=64),
}


def tiny(model_type: str, seed: int = 0, **overrides):
    """A randomly initialised tiny causal LM of `model_type`, in eval mode, fp32."""
    if model_type.split("/")[0] not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type.split('/')[0]!r}")
    kwargs = {"vocab_size": VOCAB, **SPECIAL_IDS, **FAMILIES.get(model_type, {}), **overrides}
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type.split("/")[0], **kwargs)).eval()


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


def _generate(model, ids, mask):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)


# The inner loop (`scripts/test.sh --fast`) converts one family per way of writing the MLP; the rest are slow.
INNER_LOOP = {"llama", "gemma", "phi3", "gpt2", "bloom", "ctrl", "opt"}


def _families() -> list:
    return [name if name in INNER_LOOP else pytest.param(name, marks=pytest.mark.slow) for name in sorted(FAMILIES)]


def test_the_table_covers_30_model_types():
    assert INNER_LOOP <= set(FAMILIES)
    assert len({name.split("/")[0] for name in FAMILIES}) >= 30


@pytest.mark.parametrize("family", _families())
def test_upcycling_is_exact(family):
    dense = tiny(family)
    assert dense.config.get_text_config().num_hidden_layers == LAYERS
    ids = random_ids(2, 24)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in the second row
    ref = _logits(dense, ids, attention_mask=mask)
    ref_tokens = _generate(dense, ids[:, :8], mask[:, :8])

    moe = convert_to_moe(dense, num_experts=4, top_k=2)

    assert isinstance(moe, MoEForCausalLM) and len(moe_blocks(moe)) == LAYERS
    with torch.no_grad():
        out = moe(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert len(out.router_logits) == LAYERS  # every block is on the forward path: the match is not vacuous
    torch.testing.assert_close(out.logits, ref, rtol=0, atol=ATOL)
    assert torch.equal(out.logits.argmax(-1), ref.argmax(-1))
    assert torch.equal(_generate(moe, ids[:, :8], mask[:, :8]), ref_tokens)  # KV cache path


@pytest.mark.slow
def test_checkpoints_with_token_ids_past_the_vocabulary_load(tmp_path):
    """transformers' default token ids (GPT-2's eos 50256, phi3's 32000, ...) lie past a tiny (or resized) vocabulary:
    transformers loads such a config with a warning, but hf_moe's range checks refused the checkpoints it had saved
    itself (12 of 34 families). Every family whose defaults do so saves and passes every check before load; four of
    them load, with the same logits. (A pad id the family's embedding uses as padding_idx must be inside the
    vocabulary, or transformers cannot build the model: it is set to 0.)"""
    from hf_moe.checkpoint import validate_checkpoint

    ids, tried, failed = random_ids(1, 8), [], []
    for family, kwargs in sorted(FAMILIES.items()):
        model_type = family.split("/")[0]
        if model_type not in CONFIG_MAPPING:
            continue
        config = AutoConfig.for_model(model_type, vocab_size=VOCAB, **kwargs)
        past = {k: v for k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
                if (v := getattr(config, k, None)) is not None
                and any(i >= VOCAB for i in (v if isinstance(v, list) else [v]))}
        if not past:
            continue
        if "pad_token_id" in past:
            config.pad_token_id = 0
        torch.manual_seed(0)
        moe = convert_to_moe(AutoModelForCausalLM.from_config(config).eval(), num_experts=2, top_k=1, verify=False)
        tried.append(family)
        try:
            moe.save_pretrained(tmp_path / family)
            if family in ("gpt2", "phi3", "starcoder2", "smollm3"):
                loaded = MoEForCausalLM.from_pretrained(tmp_path / family)
                assert torch.equal(_logits(loaded.eval(), ids), _logits(moe.eval(), ids))
            else:
                validate_checkpoint(tmp_path / family, verify_checksums=False)
        except Exception as err:  # noqa: BLE001 - every family is tried, then every failure shown
            failed.append(f"{family} {past}: {type(err).__name__}: {str(err)[:200]}")
    assert len(tried) >= 12 and not failed, (tried, failed)


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_mlp_that_adds_the_residual_keeps_its_forward_and_round_trips(family, tmp_path):
    """Bloom's and MPT's MLP forwards add the residual: the block replaces the up projection inside the MLP."""
    ids = random_ids(2, 16)
    dense = tiny(family)
    ref = _logits(dense, ids)
    moe = convert_to_moe(dense, num_experts=4, top_k=2)
    mlp, up, act, down = {
        "bloom": ("mlp", "dense_h_to_4h", "gelu_impl", "dense_4h_to_h"), "mpt": ("ffn", "up_proj", "act", "down_proj")
    }[family]
    assert moe.config.moe_block_path == f"{mlp}.{up}"
    assert moe.config.moe_bypassed_paths == [f"{mlp}.{act}", f"{mlp}.{down}"]
    moe.save_pretrained(tmp_path)
    loaded = MoEForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_logits(loaded, ids), ref, rtol=0, atol=ATOL)


def test_activation_with_another_formula_is_matched_to_rounding():
    from transformers.models.bloom.modeling_bloom import BloomGelu

    # BloomGelu writes the tanh GELU out by hand, as gelu_fast does: an exact match.
    assert activation_name(BloomGelu()) == "gelu_fast"
    # The tanh GELU through 0.5 * (1 + tanh(z)) = sigmoid(2z): the same function, rounded differently.
    sigmoid_form = lambda x: x * torch.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))  # noqa: E731
    x = torch.linspace(-8, 8, 2001)
    name = activation_name(sigmoid_form)
    assert _KERNEL_NAMES.get(name) == "gelu_tanh" and not torch.equal(ACT2FN[name](x), sigmoid_form(x))
    # A different function (the erf GELU differs from the tanh one by up to 5e-4) is not matched to it.
    assert activation_name(torch.nn.GELU()) == "gelu"
    with pytest.raises(NoMLPFoundError, match="matches no entry"):
        activation_name(lambda x: ACT2FN["gelu_new"](x) * 1.001)


@pytest.mark.parametrize("key", sorted(_KERNEL_NAMES))
def test_kernel_aliases_compute_the_kernels_function(key):
    """An ACT2FN key may run on a compiled kernel only if it computes the kernel's function (to fp32 rounding)."""
    x = torch.linspace(-10, 10, 4001, dtype=torch.float64).float()
    reference = ACT2FN[KERNEL_ACTIVATIONS[_KERNEL_NAMES[key]]](x)
    torch.testing.assert_close(ACT2FN[key](x), reference, rtol=1e-6, atol=1e-6)


# -- families that cannot be converted exactly ---------------------------------------------------------------------
def test_bitnet_mlp_with_an_inner_norm_is_refused_and_the_norm_named():
    # BitNet normalises the GLU output (ffn_sub_norm) before the down projection and quantises its weights.
    with pytest.raises(NoMLPFoundError, match=r"could not reproduce its output.*holds ffn_sub_norm \(BitNetRMSNorm\)"):
        convert_to_moe(tiny("bitnet", **_D), num_experts=4, top_k=2)


def test_apertus_learned_activation_is_refused():
    # xIELU has trained parameters per layer; an expert applies a fixed ACT2FN function.
    with pytest.raises(NoMLPFoundError, match=r"XIELUActivation has learnable parameters \(alpha_p, alpha_n\)"):
        convert_to_moe(tiny("apertus", **_D), num_experts=4, top_k=2)


def test_gemma3n_sparse_activation_layers_are_refused_but_the_others_convert():
    # Gemma 3n keeps only the top activations (a Gaussian top-k) in its first layers: not act(x W_gate) * x W_up.
    kwargs = dict(FAMILIES["gemma3n_text"], activation_sparsity_pattern=[0.95, 0.0])
    with pytest.raises(NoMLPFoundError, match=r"could not reproduce its output.*convert the others with `layers"):
        convert_to_moe(tiny("gemma3n_text", **kwargs), num_experts=4, top_k=2)
    dense = tiny("gemma3n_text", **kwargs)
    ids = random_ids(2, 16)
    ref = _logits(dense, ids)
    moe = convert_to_moe(dense, num_experts=4, top_k=2, layers=[1])
    torch.testing.assert_close(_logits(moe, ids), ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "family,kwargs,found",
    [
        # RWKV's channel mixing (key, receptance, value with a token shift) has no MLP shape.
        ("rwkv", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, attention_hidden_size=64),
         r"RwkvBlock\. Its children are: .*feed_forward \(RwkvFeedForward\)"),
        # Mamba's layers are a norm and a mixer: there is no MLP at all.
        ("mamba", dict(hidden_size=64, num_hidden_layers=LAYERS, state_size=8), r"MambaBlock\. Its children are: norm"),
    ],
)
def test_family_without_an_mlp_names_what_it_found_and_what_it_looks_for(family, kwargs, found):
    with pytest.raises(NoMLPFoundError, match=rf"Could not find an MLP to convert in {found}.*holding Linear/Conv1D"):
        convert_to_moe(tiny(family, **kwargs), num_experts=4, top_k=2)


def test_mlp_with_unknown_names_is_found_by_its_shapes():
    """Projections named nothing hf_moe knows are read by shape; the activation from what the forward computes."""

    class Feedforward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj_in, self.proj_gate, self.proj_out = (torch.nn.Linear(64, 96), torch.nn.Linear(64, 96),
                                                           torch.nn.Linear(96, 64))

        def forward(self, x):  # gate second, and the activation a function call
            return self.proj_out(self.proj_in(x) * torch.nn.functional.gelu(self.proj_gate(x), approximate="tanh"))

    dense = tiny("llama")
    for layer in dense.model.layers:
        layer.mlp = Feedforward()
    ids = random_ids(2, 16)
    ref = _logits(dense, ids)
    moe = convert_to_moe(dense, num_experts=4, top_k=2)
    assert moe.config.expert_glu and moe.config.expert_bias
    assert _KERNEL_NAMES.get(moe.config.expert_hidden_act) == "gelu_tanh"
    torch.testing.assert_close(_logits(moe, ids), ref, rtol=0, atol=ATOL)
