"""transformers' own MoE models in the one-op decode step (hf_moe.decode_one_op): Mixtral, Qwen2-MoE (its gated
shared expert) and Qwen3-MoE (per-head q/k norms, a dense layer among MoE ones) loaded with
`experts_implementation="hf_moe"`, decoded by `hf_moe.generate(model, ...)` (transformers' `generate` with
`custom_generate=one_op_sample`: hf_moe replaces nothing of transformers), give the eager model's tokens and scores,
left-padded batches included; OLMoE (q/k norms over all heads) is refused with the reason and decodes eagerly; two
threads may share a model.

int8 experts run the one-op step on every CPU; fp32 and bf16 experts only where their compiled kernel runs in eager
mode too (AVX-512 BF16), so those cases skip elsewhere.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_moe
from hf_moe.decode import choose_decode
from hf_moe.decode_one_op import PLAN, one_op_reason
from hf_moe.generation import generate, one_op_sample

from conftest import StreamedTokens, assert_same_greedy

FAMILIES = {
    "mixtral": dict(num_local_experts=4, intermediate_size=32),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True),
    "qwen3_moe_mixed": dict(num_experts=4, moe_intermediate_size=32, head_dim=16, mlp_only_layers=[1]),
    "olmoe": dict(num_experts=4, intermediate_size=32),
}


def native(family: str, experts: str = "int8", dtype=torch.float32, skip: bool = True):
    """A tiny transformers MoE model of `family` on hf_moe's experts, its experts int8 or left as they are; skips
    (with `skip`) where the one-op step cannot run them on this CPU."""
    from hf_moe.ops import infer, load_extension

    if load_extension()[0] is None:
        pytest.skip("the compiled extension is not loaded")
    if skip and experts != "int8" and not infer.serves(dtype):
        pytest.skip(f"the one-op step runs {experts} experts on CPUs with AVX-512 BF16 or AVX2 only")
    config = AutoConfig.for_model(family.removesuffix("_mixed"), vocab_size=96, hidden_size=32, num_hidden_layers=3,
                                  num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, **FAMILIES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="hf_moe").eval().to(dtype)
    return hf_moe.quantize_experts(model, "int8") if experts == "int8" else model


def left_padded(seed: int = 0):
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def greedy(call, model, ids, mask, **kwargs):
    return call(model, ids, attention_mask=mask, do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0,
                return_dict_in_generate=True, output_scores=True, **kwargs)


def eager(model, *args, **kwargs):
    return model.generate(*args, cache_implementation="dynamic", **kwargs)


def assert_same(reference, fast, dtype):
    """The same tokens and scores; in bf16, where the step's kernels and eager's ATen ones round in different
    places, a row may part from the reference at a near tie (two scores within about two bf16 steps)."""
    if dtype == torch.float32:
        assert_same_greedy(reference, fast, atol=1e-5, rtol=1e-5)
    else:
        assert_same_greedy(reference, fast, atol=0.05, rtol=0.02, near_tie=2**-6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("experts", ["int8", "plain"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_mixed"])
def test_native_families_decode_in_one_op_with_the_eager_tokens_and_scores(family, experts, dtype):
    if family == "mixtral" and experts == "plain" and dtype != torch.float32:
        # Mixtral's router hands its fp32 weights to the experts as they are: the step would round them
        assert "fp32 weights" in one_op_reason(native(family, experts, dtype, skip=False))
        return
    model = native(family, experts, dtype)
    assert choose_decode(model, 2).engine == "one_op", choose_decode(model, 2)
    ids, mask = left_padded()
    reference = greedy(eager, model, ids, mask)
    fast = greedy(generate, model, ids, mask)
    assert PLAN in model.__dict__  # the plan decoded
    assert_same(reference, fast, dtype)
    assert type(reference.cache).__name__ == "DynamicCache" and type(fast.cache).__name__ == "StaticCache"


def test_olmoe_is_refused_with_the_reason_and_decodes_eagerly():
    model = native("olmoe")
    choice = choose_decode(model, 2)
    assert choice.engine == "eager" and "q/k norms span all heads" in choice.reason
    ids, mask = left_padded()
    assert_same(greedy(eager, model, ids, mask), greedy(generate, model, ids, mask), torch.float32)
    assert PLAN not in model.__dict__


def test_the_loop_streams_and_refuses_what_it_cannot_serve():
    model = native("qwen3_moe")
    ids, mask = left_padded()

    streams = {}
    for name, call in (("eager", eager), ("one_op", generate)):
        streams[name] = StreamedTokens()
        greedy(call, model, ids[:1], mask[:1], streamer=streams[name])
    assert streams["one_op"].ended and streams["one_op"].tokens == streams["eager"].tokens
    with pytest.raises(ValueError, match="static cache"):  # the loop asked for by hand, without its cache
        model.generate(ids, attention_mask=mask, max_new_tokens=3, custom_generate=one_op_sample)
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, custom_generate=one_op_sample,
                       cache_implementation="static")


@pytest.mark.slow
def test_two_threads_decode_one_native_model_at_once():
    model = native("mixtral")
    prompts = [left_padded(seed) for seed in range(4)]
    expected = [greedy(eager, model, ids, mask).sequences for ids, mask in prompts]
    got, errors = [None] * len(prompts), []

    def run(i):
        try:
            got[i] = greedy(generate, model, *prompts[i]).sequences
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for want, have in zip(expected, got):
        assert torch.equal(want, have)


def test_the_former_native_names_still_work_and_warn():
    """The one-op step was called "native", the word for transformers' own models: its old public names stay for a
    release, each warning."""
    import importlib
    import sys

    from hf_moe.generation import decode_compile_config

    with pytest.warns(DeprecationWarning, match="one_op"):
        config = decode_compile_config(native=False)
    assert config.one_op is False and "one_op" not in config.to_dict() and "native" not in config.to_dict()
    sys.modules.pop("hf_moe.decode_native", None)
    with pytest.warns(DeprecationWarning, match="decode_one_op"):
        former = importlib.import_module("hf_moe.decode_native")
    assert former.native_reason is one_op_reason and former.PLAN == PLAN
