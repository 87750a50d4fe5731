"""The whole decode step as one op (hf_moe/decode_one_op.py, `torch.classes.hf_moe.DecodePlan` in
csrc/cpu/decode_step_cpu.cpp):

- it runs where every layer is one its kernels compute, says why not elsewhere, and then the attention-block step runs
  (tests/test_decode.py) as before;
- it gives the eager model's greedy tokens and scores, fp32 and bf16, Llama, Qwen2 (projection biases) and Qwen3
  (q/k norms), a left-padded batch, and a model changed between two calls; it compiles nothing;
- its rotary table holds the values the model's rotary module gives each position alone; bad arguments are refused
  with what is wrong.
"""

from __future__ import annotations

import pytest
import torch

import hf_moe
from hf_moe.decode import choose_decode
from hf_moe.decode_one_op import PLAN, DecodePlan, max_batch, one_op_reason
from hf_moe.generation import decode_compile_config
from hf_moe.ops import infer

from conftest import random_ids, tiny_converted, tiny_dense


pytestmark = pytest.mark.usefixtures("two_threads")  # the step's split of a layer's rows over threads


@pytest.fixture(autouse=True)
def _kernels():
    """The one-op step runs fp32 and bf16 experts where their compiled kernel runs in eager mode too: on a CPU with
    AVX-512 BF16 or AVX2 (hf_moe.ops.infer)."""
    from hf_moe.ops import load_extension

    if load_extension()[0] is None or not (infer.serves(torch.float32) and infer.serves(torch.bfloat16)):
        pytest.skip("the one-op step runs fp32 and bf16 experts on CPUs with AVX-512 BF16 or AVX2 only")


converted = tiny_converted


EAGER = {"cache_implementation": "dynamic"}  # the eager model: a dynamic cache asked for, nothing else runs


def greedy(model, ids, new_tokens, mask=None, **kwargs):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=0, return_dict_in_generate=True,
                          output_scores=True, **kwargs)


def one_op_step(model):
    """The decode step `generate` will use, with its compiled program replaced by one that fails: only the one-op
    step may run."""
    step = model.get_compiled_call(decode_compile_config())

    def compiled(*args):
        raise AssertionError("the compiled step ran where the one-op step should have")

    step.compiled = compiled
    return step


def test_the_one_op_step_runs_where_every_layer_allows_it_and_says_why_not_elsewhere():
    for family in ("llama", "qwen2", "qwen3"):
        assert one_op_reason(converted(family)) is None, family
        assert choose_decode(converted(family)).engine == "one_op"
    assert one_op_reason(converted().to(torch.bfloat16)) is None
    assert one_op_reason(converted(layers=[0, 2])) is None  # layer 1 stays dense: its MLP runs in the plan too
    assert "router" in one_op_reason(converted(router_type="noisy_topk"))
    skipping = converted()
    skipping.model.layers[2].mlp.gate.skip_threshold = 0.3  # dynamic skipping (config.router_skip_threshold)
    assert "layer 2's router" in one_op_reason(skipping)
    assert one_op_reason(converted(num_shared_experts=1)) is None
    dynamic = converted()
    dynamic.model.rotary_emb.rope_type = "dynamic"  # its cos/sin change with the sequence's length
    assert "rotary" in one_op_reason(dynamic)
    assert choose_decode(dynamic).engine == "eager"  # the plain call compiles nothing
    assert choose_decode(dynamic, config=decode_compile_config()).engine == "attention_block"


@pytest.mark.parametrize("family, dtype", [("llama", torch.float32), ("llama", torch.bfloat16),
                                           ("qwen2", torch.bfloat16), ("qwen3", torch.float32)])
def test_the_one_op_step_gives_the_eager_tokens_and_compiles_nothing(family, dtype, plans):
    moe = converted(family).to(dtype)
    ids = random_ids(1, 10, seed=4)
    eager = greedy(moe, ids, 6, **EAGER)
    step = one_op_step(moe)
    fast = greedy(moe, ids, 6, cache_implementation="static")
    assert len(plans) == 1 and plans[0].calls == 5  # every decode step (the first token is the prefill's)
    assert step.choice is None and moe.__dict__[PLAN] is plans[0]  # the plan outlives the call, the choice not
    assert torch.equal(eager.sequences, fast.sequences)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(torch.stack(eager.scores), torch.stack(fast.scores), **tolerance)


def test_a_padded_batch_and_a_model_quantized_between_calls(plans):
    """Rows of a left-padded batch attend to their own positions (the mask, and each row's position ids for the
    rotary table); a model quantized between two calls is read again at the second call."""
    moe = converted("qwen3").to(torch.bfloat16)
    ids = random_ids(2, 9, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    eager = greedy(moe, ids, 5, mask=mask, **EAGER)
    one_op_step(moe)
    fast = greedy(moe, ids, 5, mask=mask, cache_implementation="static")
    assert torch.equal(eager.sequences, fast.sequences)
    torch.testing.assert_close(torch.stack(eager.scores), torch.stack(fast.scores), atol=0.1, rtol=0.05)
    assert max_batch(moe) == infer.max_tokens(torch.bfloat16)  # 32 with AVX-512 BF16, any (None) with AVX2
    hf_moe.quantize_experts(moe, "int8", linears=True)
    assert PLAN not in moe.__dict__  # dropped by quantize_experts, with the weights it replaced
    eager = greedy(moe, ids, 5, mask=mask, **EAGER)
    fast = greedy(moe, ids, 5, mask=mask, cache_implementation="static")
    assert len(plans) == 2 and max_batch(moe) is None  # int8 experts: any batch
    assert all(plan.calls == 4 for plan in plans)
    assert torch.equal(eager.sequences, fast.sequences)
    torch.testing.assert_close(torch.stack(eager.scores), torch.stack(fast.scores), atol=0.1, rtol=0.05)


def test_recorded_routing_and_large_bf16_batches_take_the_compiled_step():
    """Recording routing (the router's outputs kept for the losses and statistics) and a bf16 batch the eager
    experts give to torch's GEMMs (past `infer.max_tokens` rows, on a CPU with AVX-512 BF16) are left to the
    compiled step, which computes them as eager does."""
    moe = converted().to(torch.bfloat16)
    config = decode_compile_config()
    engine = lambda batch: choose_decode(moe, batch, config).engine  # noqa: E731
    limit = infer.max_tokens(torch.bfloat16)
    assert engine(1) == engine(limit or 64) == "one_op"
    if limit is not None:
        assert engine(limit + 1) == "attention_block"
        assert choose_decode(moe, limit + 1).engine == "eager"  # the plain call compiles nothing
    with moe.model.layers[0].mlp.router_recorder.recording():
        assert engine(1) == "attention_block"
    assert engine(1) == "one_op"


def test_the_rotary_table_holds_each_positions_own_values():
    moe = converted().to(torch.bfloat16)
    cos, sin = DecodePlan(moe)._rotary(64)
    probe = torch.empty(1, 1, 1, dtype=torch.bfloat16)
    for position in (0, 1, 17, 63):
        c, s = moe.model.rotary_emb(probe, torch.tensor([[position]]))
        assert torch.equal(cos[position], c[0, 0]) and torch.equal(sin[position], s[0, 0])


def test_bad_arguments_are_refused_with_what_is_wrong():
    from transformers import StaticCache

    from hf_moe.compat import cache_kwargs, static_cache_layers

    moe = converted()
    plan = DecodePlan(moe)
    cache = StaticCache(config=moe.config, max_cache_len=16)
    with torch.no_grad():
        moe(random_ids(1, 4), use_cache=True, **cache_kwargs(cache))
    layers = static_cache_layers(cache)
    ids, positions = torch.tensor([[5]]), torch.tensor([[4]])
    plan(ids, positions, None, layers)  # fine
    with pytest.raises(RuntimeError, match="has 3 layers; got caches of 2 keys"):
        plan(ids, positions, None, layers[:2])
    with pytest.raises(RuntimeError, match="one token per row"):
        plan(torch.tensor([[5, 6]]), torch.tensor([[4, 5]]), None, layers)
    with pytest.raises((IndexError, RuntimeError)):  # a position past the cache (and its rotary table)
        plan(ids, torch.tensor([[16]]), None, layers)


def _huge_pages_offered() -> bool:
    """Transparent huge pages not disabled, and MADV_COLLAPSE (Linux 6.1+)."""
    import os

    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        enabled = "[never]" not in f.read()
    return enabled and tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (6, 1)


@pytest.mark.parametrize("huge_pages", [True, False])
def test_each_generate_call_asks_for_the_weights_on_huge_pages_unless_told_not_to(huge_pages):
    """The decode step's first call of a generate call (compiled or one op) asks for the model's weights on huge
    pages: a 4 MiB embedding here, in fp32."""
    from hf_moe.huge_pages import HUGE_PAGE

    moe = hf_moe.convert_to_moe(tiny_dense(vocab_size=16384), num_experts=4, top_k=2, verify=False).eval()
    step = moe.get_compiled_call(decode_compile_config(huge_pages=huge_pages))
    ids = random_ids(1, 5)
    assert torch.equal(greedy(moe, ids, 3, cache_implementation="static",
                              compile_config=decode_compile_config(huge_pages=huge_pages)).sequences,
                       greedy(moe, ids, 3).sequences)
    if not huge_pages:
        assert step.huge_page_bytes == 0
    elif _huge_pages_offered():
        assert step.huge_page_bytes >= HUGE_PAGE


def test_weights_asked_onto_huge_pages_keep_their_values_and_addresses():
    """hf_moe.huge_pages: the kernel collapses the 2 MiB-aligned interior of a storage into huge pages (where this
    kernel offers MADV_COLLAPSE and huge pages are not disabled), once per storage; nothing about the tensor
    changes."""
    from hf_moe.huge_pages import HUGE_PAGE, back_with_huge_pages

    big = torch.randn(3 * HUGE_PAGE // 4 + 123)  # 6 MiB of fp32: at least two aligned huge pages inside
    before, address = big.clone(), big.data_ptr()
    done = back_with_huge_pages([big, big[10:], torch.ones(3)])  # a view of the same storage counts once
    assert big.data_ptr() == address and torch.equal(big, before)
    assert done % HUGE_PAGE == 0 and done <= big.numel() * 4
    if _huge_pages_offered():
        assert done >= 2 * HUGE_PAGE


def test_the_plan_reads_the_layers_small_weights_from_copies_on_huge_pages_with_the_same_logits():
    """The plan copies its layers' small weights (attention, routers, norms) side by side into one buffer asked onto
    huge pages, the budget allowing (an eighth of the weights), and its logits equal those of a plan that reads every
    weight in place; `huge_pages=False` copies nothing. The model's own weights are untouched."""
    from transformers import StaticCache

    from hf_moe.compat import cache_kwargs, static_cache_layers
    from hf_moe.huge_pages import SMALL, copies_on_huge_pages, offered

    if not offered():
        pytest.skip("this kernel offers no transparent huge pages: nothing is copied")
    moe = converted().to(torch.bfloat16)
    before = {name: (t.data_ptr(), t.clone()) for name, t in moe.state_dict().items()}
    copied, in_place = DecodePlan(moe), DecodePlan(moe, huge_pages=False)
    assert in_place.copies is None
    attention = moe.model.layers[0].self_attn
    small = [t for t in moe.parameters() if t.untyped_storage().nbytes() < SMALL]
    total = sum(t.numel() * t.element_size() for t in moe.parameters())
    assert copied.copies is not None and 0 < copied.copies.numel() <= total // 8 + SMALL // 2
    assert attention.q_proj.weight.untyped_storage().nbytes() < SMALL and len(small) > 4
    for name, t in moe.state_dict().items():  # the copies are the plan's
        assert t.data_ptr() == before[name][0] and torch.equal(t, before[name][1]), name

    def logits(plan):
        cache = StaticCache(config=moe.config, max_cache_len=16)
        with torch.no_grad():
            moe(random_ids(2, 5, seed=3), use_cache=True, **cache_kwargs(cache))
        return plan(torch.tensor([[7], [9]]), torch.tensor([[5], [5]]), None, static_cache_layers(cache))

    assert torch.equal(logits(copied), logits(in_place))
    # a tensor named twice is copied once; one past the budget, or too large, stays where it was
    a, b, big = torch.randn(8, 8), torch.randn(4), torch.randn(SMALL // 4)
    groups, buffer = copies_on_huge_pages([{"a": a, "b": b}, {"a": a, "big": big, "none": None}], budget=256 + 63)
    assert groups[0]["a"] is groups[1]["a"] and groups[1]["big"] is big and groups[1]["none"] is None
    assert groups[0]["b"] is b  # `a` took 256 bytes; `b` needs 64 (a cache line)
    assert torch.equal(groups[0]["a"], a) and groups[0]["a"].data_ptr() != a.data_ptr()
    assert buffer.data_ptr() <= groups[0]["a"].data_ptr() < buffer.data_ptr() + buffer.numel()


@pytest.mark.subprocess
def test_the_huge_pages_benchmark_runs_and_prints_its_table(tmp_path):
    """benchmarks/huge_pages.py on a tiny saved model: both copies decode, the table is printed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    converted().to(torch.bfloat16).save_pretrained(tmp_path / "moe")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "huge_pages.py"
    done = subprocess.run([sys.executable, str(script), "--model", str(tmp_path / "moe"), "--steps", "30"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| 4 KiB pages |" in done.stdout and "| huge pages |" in done.stdout, done.stdout
