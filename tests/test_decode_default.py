"""The plain call is the fast path (hf_moe.generation.prepare_generate_kwargs, hf_moe.decode.choose_decode):

- `model.generate(**inputs)` with no cache arguments, `pipeline("text-generation")` and `hf-moe generate` with its
  defaults run the one-op step (hf_moe.decode_one_op) wherever it serves the model, with nothing compiled, and give
  the eager model's tokens and scores (fp32 and bf16 activations, a left-padded batch);
- where only a compiled step would serve, the plain call stays eager, compiles nothing, and says why (INFO log);
- an explicit choice of the caller (a cache implementation, a compile config, a cache, extra outputs) is obeyed;
- the plan is built once, kept across calls, and rebuilt when the weights change; two threads may decode at once.

int8 experts run the one-op step on every CPU; fp32 and bf16 experts only where their compiled kernel runs in eager
mode too (AVX-512 BF16 or AVX2: hf_moe.ops.infer.serves), so those cases skip elsewhere.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest
import torch
from transformers import CompileConfig, DynamicCache, StaticCache, pipeline

import hf_moe
from hf_moe.compat import CACHE_NAME, static_cache_layers
from hf_moe.decode import choose_decode
from hf_moe.decode_one_op import PLAN
from hf_moe.generation import decode_compile_config, one_op_sample, prepare_generate_kwargs

from conftest import (
    StreamedTokens, assert_same_greedy, cpu_has_avx2_fma, random_ids, tiny_converted, tiny_dense, tiny_tokenizer,
)

EAGER = {"cache_implementation": "dynamic"}  # the eager model: a dynamic cache asked for, nothing else runs


def _kernels_take(experts: str, dtype: torch.dtype) -> bool:
    from hf_moe.ops import infer, load_extension

    return load_extension()[0] is not None and (experts == "int8" or infer.serves(dtype))


def converted(dtype=torch.float32, family: str = "llama", **convert):
    """A tiny converted model in eval mode, its experts as the conversion leaves them."""
    return tiny_converted(family, **convert).to(dtype)


def model_with(experts: str = "int8", dtype=torch.float32, family: str = "llama", **convert):
    """A tiny converted model, its experts int8 (`experts="int8"`) or left as they are ("plain"); skips where the
    one-op step cannot run them on this CPU."""
    if not _kernels_take(experts, dtype):
        pytest.skip(f"the one-op step runs {experts} experts on CPUs with AVX-512 BF16 or AVX2 only")
    moe = converted(dtype, family, **convert)
    return hf_moe.quantize_experts(moe, "int8") if experts == "int8" else moe


def greedy(model, ids, new_tokens, mask=None, **kwargs):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=0, return_dict_in_generate=True,
                          output_scores=True, **kwargs)


def assert_same(eager, fast, dtype):
    """The same tokens, and scores within the dtype's tolerance."""
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    assert_same_greedy(eager, fast, **tolerance)


@pytest.fixture
def plans(plans, monkeypatch):
    """conftest's plans, with torch.compile refused (nothing may compile)."""
    import hf_moe.decode

    def refuse(*args, **kwargs):
        raise AssertionError("the plain call compiled something")

    monkeypatch.setattr(hf_moe.decode.torch, "compile", refuse)
    return plans


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp32_and_bf16_experts_take_the_one_op_step_on_a_cpu_with_avx2(dtype):
    """A CPU with AVX2 and FMA, with or without AVX-512 BF16, runs fp32 and bf16 experts on the inference kernel (its
    avx2 set beats torch's GEMMs there: docs/serving-cpu.md), so the plain call of such a model decodes with the
    one-op step, not eagerly. The CPU's flags are read here, not asked of hf_moe."""
    from hf_moe.ops import load_extension

    if load_extension()[0] is None or not cpu_has_avx2_fma():
        pytest.skip("needs the compiled extension and a CPU with AVX2 and FMA")
    moe = converted(dtype)
    choice = choose_decode(moe, 2)
    assert choice.engine == "one_op", choice.reason


def test_a_model_that_decoded_with_its_plan_is_freed_with_its_last_reference(plans):
    """The model keeps its plan; the plan does not keep the model, so `del model` frees the weights at once, not at
    the garbage collector's next run (the plans fixture keeps the plans themselves)."""
    moe = model_with("int8")
    greedy(moe, random_ids(1, 6), 3)
    assert len(plans) == 1
    gone = weakref.ref(moe)
    gc.disable()  # a collection here would hide a cycle
    try:
        del moe
        assert gone() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("experts", ["int8", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_plain_call_runs_the_one_op_step_with_the_eager_tokens_and_scores(experts, dtype, plans):
    moe = model_with(experts, dtype, family="qwen3")
    ids = random_ids(2, 9, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left-padded
    eager = greedy(moe, ids, 6, mask=mask, **EAGER)
    assert not plans
    fast = greedy(moe, ids, 6, mask=mask)
    assert len(plans) == 1 and plans[0].calls == 5  # every decode step (the first token is the prefill's)
    assert_same(eager, fast, dtype)
    again = greedy(moe, ids, 6, mask=mask)  # the plan is kept: built once
    assert len(plans) == 1 and plans[0].calls == 10 and moe.__dict__[PLAN] is plans[0]
    assert torch.equal(again.sequences, eager.sequences)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stack", ["shared_experts", "gated_shared_experts", "dense_layer"])
def test_shared_experts_and_dense_layers_run_in_the_plan_with_the_eager_tokens_and_scores(stack, dtype, plans):
    """Qwen2-MoE's shared experts (gated or not) and a layer the conversion left dense run in the plan, with the
    kernels their eager modules call; a left-padded batch."""
    convert = {"dense_layer": dict(layers=[0, 2])}.get(stack, dict(num_shared_experts=1))
    moe = model_with("int8", dtype, family="qwen2", **convert)
    if stack == "gated_shared_experts":  # as config.shared_expert_gate builds it (hf-moe merge, architecture qwen)
        torch.manual_seed(1)
        for layer in moe.model.layers:
            layer.mlp.shared_expert_gate = torch.nn.Linear(moe.config.hidden_size, 1, bias=False).to(dtype)
    assert choose_decode(moe, 2).engine == "one_op"
    ids = random_ids(2, 9, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    eager = greedy(moe, ids, 6, mask=mask, **EAGER)
    fast = greedy(moe, ids, 6, mask=mask)
    assert len(plans) == 1 and plans[0].calls == 5
    assert_same(eager, fast, dtype)


def test_the_plain_call_runs_the_steps_own_loop_or_the_plan_in_transformers_loop_where_it_must(plans, monkeypatch):
    """The plain call decodes in the one-op step's own loop (`one_op_sample`): transformers' loop and its compiled
    call (the DecodeStep) are not used, each token after the prompt's is one call of the plan, a streamer gets the
    prompt, each new token and the end, and the weights are asked onto huge pages. Where that loop cannot run the
    call (`prefill_chunk_size`: it prefills in one forward), the same plan runs inside transformers' loop, through the
    DecodeStep. Both give the eager tokens."""
    import hf_moe.generation

    asked = []
    monkeypatch.setattr(hf_moe.generation, "back_with_huge_pages", lambda tensors: asked.append(list(tensors)) or 0)
    moe = model_with("int8")
    ids = random_ids(1, 9, seed=8)
    streamers = {"eager": StreamedTokens(), "fast": StreamedTokens()}
    eager = greedy(moe, ids, 6, streamer=streamers["eager"], **EAGER)
    fast = greedy(moe, ids, 6, streamer=streamers["fast"])
    assert torch.equal(fast.sequences, eager.sequences)
    assert len(plans) == 1 and plans[0].calls == 5 and "_hf_moe_decode_steps" not in moe.__dict__
    assert len(asked) == 1 and {id(p) for p in moe.parameters()} <= {id(t) for t in asked[0]}
    assert streamers["fast"].tokens == streamers["eager"].tokens and len(streamers["fast"].tokens) == 1 + 6
    assert streamers["fast"].ended

    chunked = greedy(moe, ids, 6, prefill_chunk_size=4)  # chunks of 4, 4 and 1 token(s): the last is a plan call
    assert torch.equal(chunked.sequences, eager.sequences)
    assert len(plans) == 1 and plans[0].calls == 5 + 6 and moe._hf_moe_decode_steps[0][1].choice is None


def test_pipeline_and_the_cli_run_the_one_op_step_by_default(plans, tmp_path, capsys):
    from hf_moe.cli import main

    moe = model_with("int8")
    tokenizer = tiny_tokenizer()
    generate = pipeline("text-generation", model=moe, tokenizer=tokenizer)
    fast = generate("the fox", max_new_tokens=5, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert len(plans) == 1 and plans[0].calls == 4
    eager = generate("the fox", max_new_tokens=5, do_sample=False, return_full_text=False, **EAGER)
    assert plans[0].calls == 4 and fast == eager[0]["generated_text"]

    torch.manual_seed(0)
    hf_moe.convert_to_moe(tiny_dense(seed=0), num_experts=4, top_k=2, verify=False).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    code = main(["generate", str(tmp_path / "m"), "the quick", "--max-new-tokens", "6", "--quantize", "int8"])
    assert code == 0, capsys.readouterr().err
    assert len(plans) == 2 and plans[1].calls == 5


def test_an_explicit_choice_is_obeyed(plans):
    moe = model_with("int8")
    ids = random_ids(1, 8, seed=3)
    prepare = lambda **kw: prepare_generate_kwargs(moe, (ids,), kw)  # noqa: E731
    assert prepare()["custom_generate"] is one_op_sample  # the plain call: the one-op step's loop
    for choice in (EAGER, {"disable_compile": True}, {"past_key_values": DynamicCache()}, {"num_beams": 2},
                   {"output_hidden_states": True}, {"use_cache": False}):
        assert prepare(**choice) == choice, choice
    mine = CompileConfig(fullgraph=False)
    kept = prepare(cache_implementation="static", compile_config=mine)
    assert kept["compile_config"] is mine and choose_decode(moe, 1, mine).engine == "compiled"
    assert prepare(cache_implementation="static")["compile_config"] == decode_compile_config()
    for kwargs in (EAGER, {"output_hidden_states": True}, {"past_key_values": DynamicCache()}):
        greedy(moe, ids, 3, **kwargs)
    assert not plans


def test_where_only_a_compiled_step_would_serve_the_plain_call_stays_eager_and_says_why(plans, caplog):
    moe = model_with("int8", router_type="noisy_topk")  # not a plain top-k router: the attention-block step only
    choice = choose_decode(moe, 1)
    assert choice.engine == "eager" and "router" in choice.reason
    assert choose_decode(moe, 1, decode_compile_config()).engine == "attention_block"
    ids = random_ids(1, 8, seed=3)
    with caplog.at_level(logging.INFO, logger="hf_moe"):
        out = greedy(moe, ids, 4)  # plans refuses torch.compile: nothing compiles
        greedy(moe, ids, 4)
    said = [r.getMessage() for r in caplog.records if "decodes with" in r.getMessage()]
    assert len(said) == 1 and "eager engine" in said[0] and "router" in said[0], said
    assert not plans and torch.equal(out.sequences, greedy(moe, ids, 4, **EAGER).sequences)
    served = model_with("int8")
    served.config._attn_implementation = "eager"  # additive float masks: the one-op step takes sdpa's boolean ones
    assert choose_decode(served, 1).engine == "eager" and "'eager'" in choose_decode(served, 1).reason


def test_the_plan_is_rebuilt_when_the_weights_change_and_only_then(plans):
    """In-place edits (counted by torch's version counters), replaced modules, a dtype change: each rebuilds the
    plan at the next call, whose tokens are the changed eager model's; nothing changed, nothing is rebuilt."""
    moe = model_with("int8")
    ids = random_ids(2, 8, seed=6)
    greedy(moe, ids, 4)
    greedy(moe, ids, 4)
    assert len(plans) == 1
    edits = [
        lambda m: m.model.layers[1].mlp.gate.weight.mul_(-3.0),  # the router: the plan's fp32 copy must follow
        lambda m: m.lm_head.weight.mul_(2.0),
        lambda m: m.model.layers[0].self_attn.v_proj.weight.mul_(-2.0),  # the plan reads a copy on huge pages
        lambda m: m.model.layers[2].mlp.experts.down_proj_scale.mul_(0.5),
        lambda m: m.to(torch.bfloat16),
    ]
    for n, edit in enumerate(edits, start=2):
        with torch.no_grad():
            edit(moe)
        eager = greedy(moe, ids, 4, **EAGER)
        fast = greedy(moe, ids, 4)
        assert len(plans) == n, n
        assert_same(eager, fast, moe.dtype)


def test_two_threads_generating_on_one_model_both_get_the_eager_answers(plans):
    moe = model_with("int8")
    prompts = [random_ids(1, 7, seed=10), random_ids(2, 11, seed=11)]
    eager = [greedy(moe, ids, 8, **EAGER).sequences for ids in prompts]
    results, errors = {}, []

    def run(i):
        try:
            for _ in range(3):
                results.setdefault(i, []).append(greedy(moe, prompts[i], 8).sequences)
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        assert all(torch.equal(seq, eager[i]) for seq in results[i])
    assert sum(plan.calls for plan in plans) == 2 * 3 * 7


def test_the_plan_names_its_fields_and_refuses_missing_or_misfit_ones():
    """The plan's fields cross into C++ by name, checked once when the plan is built (not at every step)."""
    from hf_moe.decode_one_op import layer_fields, model_fields

    moe = model_with("int8")
    tensors, settings = model_fields(moe)
    layer, numbers, names = layer_fields(moe.model.layers[0], torch.float32)
    assert {"input_norm", "q.weight", "k.bias", "router", "w1", "w2_scale"} <= set(layer)
    assert set(numbers) == {"head_dim", "eps", "qk_eps", "scaling", "post_eps", "router_in_dtype"} and names == {}

    def build(layer_tensors):
        plan = torch.classes.hf_moe.DecodePlan(
            {k: v for k, v in tensors.items() if v is not None}, {"final_eps": settings["final_eps"]},
            settings["top_k"], settings["norm_topk_prob"], settings["activation"], settings["glu"])
        plan.add_layer({k: v for k, v in layer_tensors.items() if v is not None},
                       {k: float(v) for k, v in numbers.items()}, names)
        return plan

    assert build(layer).num_layers() == 1
    with pytest.raises(RuntimeError, match="layer 0 has no tensor q.weight"):
        build({k: v for k, v in layer.items() if k != "q.weight"})
    with pytest.raises(RuntimeError, match="projection shapes do not fit"):
        build(dict(layer, **{"o.weight": layer["o.weight"][:, :-2].contiguous()}))
    with pytest.raises(RuntimeError, match="router weight must be"):
        build(dict(layer, router=layer["router"][:, :-1]))


def test_a_step_reuses_the_plans_workspace():
    """The plan's workspace (the router's logits and softmax, the routing weights, the experts' output and host
    buffers, the final norm, the attention sub-block's) is made once for the largest batch seen: later steps, of that
    batch or a smaller one, compute in the same memory, and one step allocates only the logits it returns and calls
    ATen for little but the embedding's rows."""
    moe = model_with("int8")
    ids = random_ids(2, 5)
    greedy(moe, ids, 3)
    plan = moe.__dict__[PLAN]
    first = plan.op.workspace_addresses()
    assert 0 not in first
    greedy(moe, random_ids(2, 6, seed=1), 4)
    assert plan.op.workspace_addresses() == first
    greedy(moe, ids[:1], 3)  # a smaller batch: views of the same buffers
    assert plan.op.workspace_addresses() == first

    # one step by hand, its allocations (through torch's allocator) counted by the profiler
    cache = StaticCache(config=moe.config, max_cache_len=16)
    moe(ids, **{CACHE_NAME: cache})
    layers = static_cache_layers(cache)
    step = (ids[:, -1:].contiguous(), torch.full((2, 1), 5), None, layers)
    plan(*step)  # the batch's views taken
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        plan(*step)
    allocated = [e.cpu_memory_usage for e in prof.events()
                 if e.name in ("aten::empty", "aten::empty_strided") and e.cpu_memory_usage > 0]
    logits = 2 * moe.config.vocab_size * 4
    assert allocated == [logits], allocated
    # ATen only takes the embedding's and the rotary embedding's rows, and views: the router and the final norm run in
    # the plan's loops (ATen's kernels there cost several times their work: a step's weights evict their code from
    # the caches)
    called = {e.name for e in prof.events() if e.name.startswith("aten::")}
    assert called <= {"aten::index_select", "aten::empty", "aten::reshape", "aten::view", "aten::as_strided",
                      "aten::select", "aten::unsqueeze"}, called


def test_the_former_fused_names_still_work_and_warn():
    """The attention-block step was called "fused", the word kept for stacked expert weights: its old public names
    (the engine's name a choice compares equal to, the config's field and argument, the step's class, the engine's
    constant) stay for a release, each warning; the new names warn nowhere."""
    import warnings

    import hf_moe.decode as decode

    with pytest.warns(DeprecationWarning, match="hf_moe_step"):
        config = decode_compile_config(fused=False)
    assert config.hf_moe_step is False and not {"fused", "hf_moe_step"} & set(config.to_dict())
    with pytest.warns(DeprecationWarning, match="hf_moe_step"):
        assert config.fused is False
    with pytest.warns(DeprecationWarning, match="DecodeStep"):
        assert decode.FusedDecodeStep is decode.DecodeStep
    with pytest.warns(DeprecationWarning, match="ATTENTION_BLOCK"):
        assert decode.FUSED == decode.ATTENTION_BLOCK == "attention_block"
    choice = decode.DecodeChoice(decode.ATTENTION_BLOCK, "a static cache asked for")
    with pytest.warns(DeprecationWarning, match="'attention_block'"):
        assert choice.engine == "fused"
    with pytest.warns(DeprecationWarning, match="'attention_block'"):
        assert "fused" == choice.engine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choice.engine == "attention_block" and choice.engine != "eager"
        assert decode.DecodeChoice(decode.EAGER, "why").engine != "fused"
        assert decode_compile_config().hf_moe_step is True
        assert hash(choice.engine) == hash("attention_block")
        assert str(choice) == "attention_block (a static cache asked for)"
