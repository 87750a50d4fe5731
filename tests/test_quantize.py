"""Weight-only int8 experts: the format (hf_moe/ops/int8.py), `QuantizedExperts` against dequantize-then-matmul,
`quantize_experts` on whole models, gradients and LoRA through frozen int8 experts, and saving / loading per expert
with checksums."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_ids, tiny_dense, tiny_tokenizer

import hf_moe
from hf_moe.checkpoint import CheckpointError, read_safetensors_header, verify_checkpoint
from hf_moe.layers.quantized import QuantizedExperts
from hf_moe.ops import experts_forward, use_backend
from hf_moe.ops.int8 import dequantize_int8, group_size_of, quantize_int8
from hf_moe.quantize import CONFIG_FIELD, load_quantized, quantize_experts, save_quantized
from test_ops import _Experts, _routing


# ----------------------------------------------------------------------------------------------------------------
# The format
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group_size", [None, 32, 64])
def test_quantize_int8_rounds_to_the_nearest_step(group_size):
    w = torch.randn(3, 40, 128) * torch.rand(3, 40, 1) * 4
    w[0, 5] = 0.0  # a channel of zeros
    q, scale = quantize_int8(w, group_size)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape
    assert scale.shape == ((3, 40) if group_size is None else (3, 40, 128 // group_size))
    assert group_size_of(q, scale) == group_size
    assert q.abs().max() == 127 and torch.equal(q[0, 5], torch.zeros(128, dtype=torch.int8))
    step = scale.unsqueeze(-1) if group_size is None else scale.repeat_interleave(group_size, -1)
    error = (dequantize_int8(q, scale) - w).abs()
    assert (error <= step / 2 * (1 + 1e-6) + 1e-12).all()


def test_quantize_int8_rejects_bad_groups():
    with pytest.raises(ValueError, match="multiple of 32 that divides 96"):
        quantize_int8(torch.randn(4, 96), 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int8(torch.randn(4, 96), 48)


# ----------------------------------------------------------------------------------------------------------------
# QuantizedExperts against dequantize-then-matmul
# ----------------------------------------------------------------------------------------------------------------
def _dequantized_copy(quantized: QuantizedExperts, dtype) -> _Experts:
    """A plain experts module holding the dequantized weights: the oracle of `QuantizedExperts`."""
    plain = _Experts(quantized.num_experts, quantized.hidden_dim, quantized.intermediate_dim, quantized.has_gate,
                     quantized.has_bias, quantized.activation, dtype=dtype)
    with torch.no_grad():
        for name, weight in quantized.dequantized(dtype).items():
            getattr(plain, name).copy_(weight)
        for name in ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias"):
            if getattr(plain, name) is not None:
                getattr(plain, name).copy_(getattr(quantized, name))
    return plain.requires_grad_(False)


@pytest.mark.parametrize("backend", ["compiled", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("glu,bias,group_size", [(True, False, None), (False, True, None), (True, True, 32)])
def test_quantized_experts_equal_dequantize_then_matmul(glu, bias, group_size, dtype, backend):
    source = _Experts(4, 64, 96, glu=glu, bias=bias, dtype=torch.float32)
    quantized = QuantizedExperts.from_experts(source, group_size).to(dtype)
    oracle = _dequantized_copy(quantized, dtype).double()  # the weights the kernel multiplies, in fp64
    index, weights = _routing(13, 2, 4, "dropped")
    x = torch.randn(13, 64, dtype=dtype)
    with use_backend(backend), torch.no_grad():
        got = quantized(x, index, weights.to(dtype))
        want = experts_forward(oracle, x.double(), index, weights)
    # bf16: the kernel rounds the activations between the two products, and the output, to bf16
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_scales_stay_fp32_and_weights_int8_through_model_to():
    quantized = QuantizedExperts.from_experts(_Experts(2, 32, 32, dtype=torch.float32))
    scale = quantized.gate_up_proj_scale.clone()
    quantized.to(torch.bfloat16)
    assert quantized.gate_up_proj.dtype == torch.int8 and quantized.gate_up_proj_scale.dtype == torch.float32
    assert torch.equal(quantized.gate_up_proj_scale, scale)
    quantized.half().float()
    assert torch.equal(quantized.gate_up_proj_scale, scale) and quantized.down_proj_scale.dtype == torch.float32


@pytest.mark.parametrize("backend", ["compiled", "torch"])
def test_gradients_flow_through_frozen_int8_experts(backend):
    """The inputs and routing weights get the gradients of the dequantized model; the int8 weights get none."""
    quantized = QuantizedExperts.from_experts(_Experts(4, 32, 48, glu=True, bias=True, dtype=torch.float32))
    oracle = _dequantized_copy(quantized, torch.float32)
    index, weights = _routing(9, 2, 4, "random")
    x = torch.randn(9, 32)
    grads = []
    for module in (quantized, oracle):
        xi, wi = x.clone().requires_grad_(True), weights.float().clone().requires_grad_(True)
        with use_backend(backend):
            out = module(xi, index, wi) if module is quantized else experts_forward(module, xi, index, wi)
        out.square().sum().backward()
        grads.append((out.detach(), xi.grad, wi.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not list(quantized.parameters())


# ----------------------------------------------------------------------------------------------------------------
# Whole models
# ----------------------------------------------------------------------------------------------------------------
def _quantized(model):
    return [m for m in model.modules() if isinstance(m, QuantizedExperts)]


def _moe(seed=0, family="llama", **kwargs):
    dense = tiny_dense(family, seed=seed)
    return hf_moe.convert_to_moe(dense, num_experts=4, top_k=2, **kwargs).eval()


def test_quantize_experts_keeps_the_logits_close():
    model = _moe()
    ids = random_ids()
    with torch.no_grad():
        want = model(ids).logits
    quantize_experts(model, "int8")
    assert len(_quantized(model)) == 3 and not any(isinstance(m, hf_moe.Experts) for m in model.modules())
    assert getattr(model.config, CONFIG_FIELD)["quant_method"] == "int8"
    with torch.no_grad():
        got = model(ids).logits
        again = model.to(torch.bfloat16)(ids).logits
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert (again.float() - want).abs().max() < 0.05 * want.abs().max()
    out = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)
    with pytest.raises(ValueError, match="quantized already"):
        quantize_experts(model, "int8")
    with pytest.raises(ValueError, match="Unknown expert quantization"):
        quantize_experts(_moe(), "int4")


def test_quantize_experts_of_a_native_transformers_moe():
    """transformers' own MoE models (Mixtral here) have experts of the same fused layout: they quantize too."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = MixtralForCausalLM(config).eval()
    ids = random_ids()
    with torch.no_grad():
        want = model(ids).logits
        got = quantize_experts(model, "int8")(ids).logits
    assert len(_quantized(model)) == 2
    assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_lora_on_attention_trains_through_int8_experts():
    """PEFT LoRA on the attention of a model with int8 experts: the adapters get the gradients they get in the
    same model with the dequantized experts, and the experts stay as they were."""
    peft = pytest.importorskip("peft")
    quantized = quantize_experts(_moe(), "int8")
    reference = _moe()
    with torch.no_grad():  # the reference holds the dequantized weights as frozen fp32 experts
        plain = [m for m in reference.modules() if isinstance(m, hf_moe.Experts)]
        for experts, qexperts in zip(plain, _quantized(quantized), strict=True):
            for name, weight in qexperts.dequantized(torch.float32).items():
                getattr(experts, name).copy_(weight)
            experts.requires_grad_(False)
    ids = random_ids()
    grads = []
    for model in (quantized, reference):
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        torch.manual_seed(1)  # the same (random, nonzero) adapters in both
        lora = peft.get_peft_model(model, config)
        lora.train()
        loss = lora(ids, labels=ids).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in lora.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6)


def test_lora_on_int8_experts_is_refused_with_what_to_target_instead():
    """int8 experts are frozen buffers: PEFT's `target_parameters` cannot reach them. With other targets PEFT only
    warned that no parameter matched, and trained an adapter without the experts the user asked for: the model refuses
    it when PEFT hands it the config, saying why and what to target. Without other targets PEFT raises its own error
    first (docs/tools.md); printing the model says it too."""
    peft = pytest.importorskip("peft")
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], target_parameters=experts)
    with pytest.raises(ValueError, match=r"int8 experts.*frozen buffers, not parameters.*target_modules"):
        peft.get_peft_model(quantize_experts(_moe(), "int8"), config)
    assert "frozen buffers, not LoRA targets" in repr(_quantized(quantize_experts(_moe(), "int8"))[0])
    # The same config on the floating-point model, and attention alone on the int8 model, are accepted.
    assert set(peft.get_peft_model(_moe(), config).peft_config["default"].target_parameters) == set(experts)
    model = quantize_experts(_moe(), "int8")
    assert not hasattr(model, "peft_config")  # as for any model without an adapter
    peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    assert model.peft_config["default"].target_modules == {"q_proj"}


# ----------------------------------------------------------------------------------------------------------------
# Saved and loaded per expert, with checksums
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,group_size", [("llama", None), ("llama", 32), ("gpt2", None)])
def test_save_and_load_per_expert(tmp_path, family, group_size):
    """Per-expert files hold each expert's int8 weights and fp32 scales (and float biases: GPT-2's experts have
    them), with checksums; the loaded model computes the same logits, in fp32 and (non-experts) in bf16."""
    model = quantize_experts(_moe(family=family), "int8", group_size=group_size)
    ids = random_ids()
    with torch.no_grad():
        want = model(ids).logits
    save_quantized(model, tmp_path / "q")
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    layer = next(k for k in index["weight_map"] if ".experts.3." in k).split(".experts.")[0]
    up = "gate_up_proj" if family == "llama" else "up_proj"
    key = f"{layer}.experts.3.{up}"
    assert index["weight_map"][key] == index["weight_map"][key + "_scale"] == "model-expert-00003.safetensors"
    header = read_safetensors_header(tmp_path / "q" / "model-expert-00003.safetensors")
    rows = header[key]["shape"][0]
    assert header[key]["dtype"] == "I8" and header[key + "_scale"]["dtype"] == "F32"
    assert header[key + "_scale"]["shape"] == ([rows] if group_size is None else [rows, 64 // group_size])
    assert (f"{layer}.experts.3.down_proj_bias" in header) == (family == "gpt2")
    assert "model-expert-00003.safetensors" in index["metadata"]["checksums"]["files"]
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config[CONFIG_FIELD] == {"quant_method": "int8", "bits": 8, "group_size": group_size, "symmetric": True,
                                    "scale_dtype": "float32"}
    loaded = load_quantized(tmp_path / "q").eval()
    assert len(_quantized(loaded)) == 3 and not any(isinstance(m, hf_moe.Experts) for m in loaded.modules())
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
    half = load_quantized(tmp_path / "q", dtype=torch.bfloat16).eval()
    experts = _quantized(half)[0]
    assert experts.down_proj_scale.dtype == torch.float32 and experts.down_proj.dtype == torch.int8
    with torch.no_grad():
        assert (half(ids).logits.float() - want).abs().max() < 0.05 * want.abs().max()


def test_load_detects_a_corrupt_expert_file(tmp_path):
    save_quantized(quantize_experts(_moe(), "int8"), tmp_path / "q")
    path = tmp_path / "q" / "model-expert-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one bit of one int8 weight
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model-expert-00002"):
        load_quantized(tmp_path / "q")


def test_load_refuses_a_changed_config(tmp_path):
    """config.json is checked against the checksum recorded at save time, as for every hf_moe load."""
    save_quantized(quantize_experts(_moe(), "int8"), tmp_path / "q")
    path = tmp_path / "q" / "config.json"
    config = json.loads(path.read_text())
    config["num_experts_per_tok"] = 1
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config files changed"):
        load_quantized(tmp_path / "q")
    with pytest.raises(CheckpointError, match="config files changed"):
        hf_moe.MoEForCausalLM.from_pretrained(tmp_path / "q", offload_experts="disk", max_expert_memory="1MiB")


def test_verify_checkpoint_of_int8_experts(tmp_path):
    """`hf-moe verify` takes an int8 checkpoint for what it is (not a float model's with wrong dtypes), and finds a
    flipped bit in it."""
    save_quantized(quantize_experts(_moe(), "int8"), tmp_path / "q")
    assert verify_checkpoint(tmp_path / "q").problems == []
    path = tmp_path / "q" / "model-expert-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    problems = verify_checkpoint(tmp_path / "q").problems
    assert problems and all(p.startswith("model-expert-00001.safetensors") for p in problems), problems


def test_save_refuses_an_unquantized_model(tmp_path):
    with pytest.raises(ValueError, match="quantize_experts"):
        save_quantized(_moe(), tmp_path / "q")


# ----------------------------------------------------------------------------------------------------------------
# Offloaded int8 experts
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["disk", "cpu"])
def test_offloaded_int8_experts_generate_like_resident_ones(tmp_path, mode):
    """A saved int8 model loads with offload_experts: the cache holds int8 experts (a quarter of the fp32 bytes
    per expert, plus the scales), reads only those, and generates the tokens and logits of the resident int8 model."""
    from hf_moe.offload import expert_cache

    model = quantize_experts(_moe(), "int8")
    save_quantized(model, tmp_path / "q")
    ids = random_ids(2, 8)

    def greedy(m):
        with torch.no_grad():
            return m.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
                              pad_token_id=0, eos_token_id=None, cache_implementation="dynamic")  # eager, both

    want = greedy(model)
    fp32_bytes = (192 * 64 + 64 * 96) * 4  # one tiny expert: gate_up [192, 64] + down [64, 96]
    int8_bytes = (192 * 64 + 64 * 96) + (192 + 64) * 4
    offloaded = hf_moe.MoEForCausalLM.from_pretrained(tmp_path / "q", offload_experts=mode,
                                                      max_expert_memory=3 * int8_bytes)
    cache = expert_cache(offloaded)
    assert cache.layout.expert_bytes(torch.float32) == int8_bytes < fp32_bytes / 3.5
    assert cache.num_slots == 3 and cache.pool["gate_up_proj"].dtype == torch.int8
    got = greedy(offloaded)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    assert cache.stats.bytes_read == int8_bytes * (cache.stats.demand_fetches + cache.stats.prefetches) > 0


@pytest.mark.parametrize("mode", ["disk", "cpu"])
def test_offloaded_int8_expert_is_verified_at_its_first_read(tmp_path, mode):
    """One flipped bit of an int8 weight: the offloaded load ("disk") hashes each expert tensor at its first read,
    and refuses it there; "cpu" reads every expert at load, and refuses the load."""
    from hf_moe.offload import expert_cache

    save_quantized(quantize_experts(_moe(), "int8"), tmp_path / "q")
    path = tmp_path / "q" / "model-expert-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))

    def load():
        return hf_moe.MoEForCausalLM.from_pretrained(tmp_path / "q", offload_experts=mode, max_expert_memory="1MiB")

    if mode == "cpu":
        with pytest.raises(CheckpointError, match="model-expert-00002.safetensors is corrupt"):
            load()
        return
    store = expert_cache(load()).store
    layout = store.layout
    fresh = {name: torch.empty(shape, dtype=layout.dtype_of(name, torch.float32))
             for name, shape in layout.shapes.items()}
    store.read_into(0, 1, fresh)  # an intact expert
    with pytest.raises(CheckpointError, match="model-expert-00002.safetensors is corrupt"):
        for layer in range(layout.num_layers):
            store.read_into(layer, 2, fresh)


@pytest.mark.compile
def test_torch_compile_fullgraph_runs_the_int8_kernel():
    """A compiled decode step (torch.compile fullgraph, no gradients) keeps the int8 kernel as one node."""
    quantized = QuantizedExperts.from_experts(_Experts(4, 64, 96, glu=True, bias=True, dtype=torch.float32))
    index, weights = _routing(2, 2, 4, "random")
    x = torch.randn(2, 64)
    with use_backend("compiled"), torch.no_grad():
        want = quantized(x, index, weights.float())
        got = torch.compile(quantized, fullgraph=True, backend="aot_eager")(x, index, weights.float())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_cli_generate_quantize_int8_streams_the_int8_models_tokens(tmp_path, capsys):
    """`hf-moe generate --quantize int8` streams what the model with int8 experts generates; a checkpoint saved
    with int8 experts is loaded as such (plain from_pretrained refuses it, naming load_quantized); --quantize with
    offloading is a clear error (exit 2)."""
    from hf_moe.cli import main

    moe = hf_moe.convert_to_moe(tiny_dense(), num_experts=4, top_k=2, noise=0.1, verify=False).eval()
    moe.save_pretrained(tmp_path / "moe")
    tiny_tokenizer().save_pretrained(tmp_path / "moe")
    tok = tiny_tokenizer()
    ids = tok("the quick", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf_moe.quantize_experts(moe, "int8").generate(ids, max_new_tokens=5, do_sample=False,
                                                                  pad_token_id=0)
    want = tok.decode(expected[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert main(["generate", str(tmp_path / "moe"), "the quick", "--max-new-tokens", "5", "--quantize", "int8"]) == 0
    assert capsys.readouterr().out.strip() == want
    hf_moe.save_quantized(moe, tmp_path / "int8")
    tiny_tokenizer().save_pretrained(tmp_path / "int8")
    assert main(["generate", str(tmp_path / "int8"), "the quick", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip() == want
    with pytest.raises(hf_moe.CheckpointError, match="load_quantized"):
        hf_moe.MoEForCausalLM.from_pretrained(tmp_path / "int8")
    assert main(["generate", str(tmp_path / "moe"), "x", "--quantize", "int8", "--offload-experts", "disk",
                 "--max-expert-memory", "1MB"]) == 2
    assert "--quantize" in capsys.readouterr().err


@pytest.mark.parametrize("glu,bias", [(True, True), (False, False)])
def test_quantized_expert_choice_equals_a_loop_over_the_dequantized_experts(glu, bias):
    """Expert-choice routing through int8 experts: each expert takes its C tokens, computed one by one here with the
    dequantized weights (q * scale) and weighted into the tokens' outputs."""
    quantized = QuantizedExperts.from_experts(_Experts(4, 32, 48, glu=glu, bias=bias, dtype=torch.float32))
    weights = quantized.dequantized(torch.float32)
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(3))
    index = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 5]])
    gates = torch.rand(4, 3, generator=torch.Generator().manual_seed(4))
    expected = torch.zeros_like(x)
    b1 = getattr(quantized, f"{quantized.up_name}_bias")
    for e in range(4):
        for slot, token in enumerate(index[e].tolist()):
            h = weights[quantized.up_name][e] @ x[token] + (b1[e] if bias else 0)
            a = torch.nn.functional.silu(h[:48]) * h[48:] if glu else quantized.act_fn(h)
            y = weights["down_proj"][e] @ a + (quantized.down_proj_bias[e] if bias else 0)
            expected[token] += gates[e, slot] * y
    torch.testing.assert_close(quantized.expert_choice(x, index, gates), expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# int8 linear layers (quantize_experts(..., linears=True))
# ----------------------------------------------------------------------------------------------------------------
def test_int8_linears_keep_the_logits_close_and_save_and_load(tmp_path):
    """linears=True: the attention projections, the dense MLP of a layer left dense, and the LM head (tied to the
    embedding: an int8 copy, the embedding stays fp32) become int8; the routers do not. The logits stay within the
    int8 experts' bound; the model saves per expert and loads back with the same logits (fp32 scales in bf16 too)."""
    from hf_moe.layers.quantized_linear import QuantizedLinear

    dense = tiny_dense("llama", tie_word_embeddings=True)
    model = hf_moe.convert_to_moe(dense, num_experts=4, top_k=2, layers=[0, 2]).eval()
    ids = random_ids()
    with torch.no_grad():
        want = model(ids).logits
    quantize_experts(model, "int8", linears=True)
    int8 = {name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    layer = "model.layers.1"
    assert {"lm_head", f"{layer}.self_attn.q_proj", f"{layer}.mlp.down_proj"} <= int8 and len(int8) == 3 * 4 + 3 + 1
    assert not any(".gate." in name or name.endswith(".gate") for name in int8)
    assert model.model.embed_tokens.weight.dtype == torch.float32 and not model.config.tie_word_embeddings
    with torch.no_grad():
        got = model(ids).logits
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    save_quantized(model, tmp_path / "q")
    header = read_safetensors_header(tmp_path / "q" / "model-00001-of-00001.safetensors")
    assert header["lm_head.weight"]["dtype"] == "I8" and header["lm_head.weight_scale"]["dtype"] == "F32"
    assert json.loads((tmp_path / "q" / "config.json").read_text())[CONFIG_FIELD]["linears"] is True
    loaded = load_quantized(tmp_path / "q").eval()
    assert {name for name, m in loaded.named_modules() if isinstance(m, QuantizedLinear)} == int8
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, got)
    half = load_quantized(tmp_path / "q", dtype=torch.bfloat16).eval()
    assert half.lm_head.weight_scale.dtype == torch.float32 and half.lm_head.weight.dtype == torch.int8
    with pytest.raises(CheckpointError, match="int8 linear layers"):
        hf_moe.MoEForCausalLM.from_pretrained(tmp_path / "q", offload_experts="disk", max_expert_memory="1MiB")


def test_int8_linears_refuse_a_group_size_that_does_not_divide_a_layer():
    with pytest.raises(ValueError, match="does not divide"):
        quantize_experts(_moe(), "int8", group_size=64 * 3, linears=True)


def test_adapter_experts_are_refused_with_materialize_first():
    """Adapter experts were converted, but hold no per-expert weights: the message says to materialize them."""
    model = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2, method="lora", rank=4, verify=False)
    with pytest.raises(ValueError, match=r"adapter experts .* Materialize them .*hf_moe.materialize\(model\)"):
        quantize_experts(model, "int8")
    quantize_experts(hf_moe.materialize(model), "int8")  # (what the message says works)
