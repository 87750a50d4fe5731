"""The bf16 linear layers of a prompt's forward in hf_moe's own generate loop run `hf_moe::linear_infer` on a CPU whose
inference kernels are the AVX2 ones, where ATen's bf16 GEMM is slow (hf_moe.ops.prefill_linears)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from hf_moe.ops.prefill_linears import LinearInferMode, linears_on_linear_infer

from conftest import random_ids, tiny_converted


def _extension():
    from hf_moe.ops import load_extension

    if load_extension()[0] is None:
        pytest.skip("needs the compiled extension")


def _avx2_kernels():
    from hf_moe.ops import infer

    _extension()
    if infer.kernel_isa() != "avx2":
        pytest.skip("the prompt's linears move only where the inference kernels are the AVX2 ones")


def test_the_mode_runs_bf16_linears_on_linear_infer_and_passes_everything_else_through():
    _extension()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 20, 64, generator=g).bfloat16()  # 60 rows: linear_infer's GEMM path
    w = torch.randn(48, 64, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    with LinearInferMode():
        got = F.linear(x, w, b)
        by_name = F.linear(input=x[0, :2], weight=w)  # 2 rows: the dot kernels
        fp32 = F.linear(x.float(), w.float(), b.float())
        trained = w.clone().requires_grad_()
        recorded = F.linear(x, trained)
    assert got.shape == (3, 20, 48) and got.dtype == torch.bfloat16
    assert torch.equal(got, torch.ops.hf_moe.linear_infer(x.reshape(60, 64), w, None, b).view(3, 20, 48))
    assert torch.equal(by_name, torch.ops.hf_moe.linear_infer(x[0, :2], w, None, None))
    # the same bf16 values multiplied in fp32 and rounded once: at most one bf16 step from that
    exact = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), exact, atol=0, rtol=2**-8)
    # untouched: fp32 tensors, and a call autograd records
    assert torch.equal(fp32, F.linear(x.float(), w.float(), b.float()))
    assert recorded.grad_fn is not None
    assert torch.equal(recorded.detach(), F.linear(x, w))


def test_the_mode_is_entered_only_where_the_avx2_kernels_run():
    _extension()
    from hf_moe.ops import infer

    mode = linears_on_linear_infer()
    assert isinstance(mode, LinearInferMode) == (infer.kernel_isa() == "avx2")


def _linear_infer_rows(run) -> list[int]:
    """The activation rows of every `hf_moe::linear_infer` call that `run()` makes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    return [e.input_shapes[0][0] for e in prof.events() if e.name == "hf_moe::linear_infer"]


def test_a_bf16_models_prompt_runs_its_linear_layers_on_linear_infer_in_the_plain_generate():
    """The plain `generate` of a bf16 hf_moe model runs the one-op step's loop, whose prompt forward computes every
    attention projection and the LM head with linear_infer (2 prompts of 12 tokens: 24 rows, the LM head on the last
    position of each: 2 rows), and gives the tokens of the eager loop."""
    _avx2_kernels()
    moe = tiny_converted().to(torch.bfloat16)
    ids = random_ids(2, 12, seed=3)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4, min_new_tokens=4,
                  pad_token_id=0)
    eager = moe.generate(ids, cache_implementation="dynamic", **kwargs)
    assert _linear_infer_rows(lambda: moe.generate(ids, cache_implementation="dynamic", **kwargs)) == []
    out = {}
    rows = _linear_infer_rows(lambda: out.update(fast=moe.generate(ids, **kwargs)))
    layers = moe.config.num_hidden_layers
    assert rows.count(24) == 4 * layers and rows.count(2) == 1, rows  # q, k, v and o of every layer; the LM head
    assert torch.equal(out["fast"], eager)


def test_the_mode_is_the_entering_threads_only():
    """torch keeps its modes per thread: a forward on another thread while one thread's prompt runs in the mode is
    ATen's own."""
    _avx2_kernels()
    x = torch.randn(40, 64).bfloat16()
    w = torch.randn(32, 64).bfloat16()
    entered, done, seen = threading.Event(), threading.Event(), {}

    def other():
        entered.wait()
        seen["rows"] = _linear_infer_rows(lambda: F.linear(x, w))
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with LinearInferMode():
        entered.set()
        done.wait(timeout=60)
    thread.join()
    assert seen["rows"] == []
