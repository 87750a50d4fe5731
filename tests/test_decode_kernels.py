"""The decode step's C++ kernels (csrc/cpu/decode_cpu.cpp) against their pure-torch references (hf_moe/ops/decode.py),
every kernel set (AVX-512 where the CPU has it, AVX2 with FMA, and the portable one), and `QuantizedLinear` against
dequantize-then-matmul. Inference only: the ops have no backward, and nothing calls them with a gradient."""

from __future__ import annotations

import pytest
import torch

from hf_moe.layers.quantized_linear import QuantizedLinear
from hf_moe.ops import load_extension
from hf_moe.ops.decode import decode_attention_block_reference, linear_infer_reference
from hf_moe.ops.int8 import dequantize_int8, quantize_int8
from test_cpu_kernels import _kernel_set_runs_here  # noqa: F401 (autouse: skips "avx2" on a CPU without it)

pytestmark = [pytest.mark.skipif(load_extension()[0] is None, reason="the compiled extension is not available"),
              pytest.mark.usefixtures("two_threads")]  # the kernels' split of rows over threads
KERNELS = ["auto", "avx2", "portable"]


def tolerance(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


LINEAR_CASES = [  # (weights, activation rows): decode (dot kernels), a small batch, a prompt (ATen's GEMM)
    ("float", 1), ("float", 5), ("float", 40), ("int8", 1), ("int8", 5), ("int8", 40), ("int8_groups", 1),
    ("int8_groups", 40),
]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights,rows", LINEAR_CASES)
def test_linear_infer_matches_dequantize_then_matmul(kernels, dtype, weights, rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 96).to(dtype)
    w = torch.randn(37, 96)  # an output count that is no multiple of the kernels' tiles
    bias = torch.randn(37).to(dtype)
    if weights == "float":
        weight, scale = w.to(dtype), None
    else:
        weight, scale = quantize_int8(w, 32 if weights == "int8_groups" else None)
    out = torch.ops.hf_moe.linear_infer(x, weight, scale, bias, kernels=kernels)
    expected = linear_infer_reference(x, weight, scale, bias)
    assert out.dtype == dtype and out.shape == (rows, 37)
    if weights != "float" and dtype == torch.bfloat16 and rows <= 16:
        # a decode dequantizes in fp32 registers: the weights are exact, not rounded to bf16 as the reference's
        expected = torch.nn.functional.linear(x.float(), dequantize_int8(weight, scale), bias.float()).to(dtype)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


def test_linear_infer_refuses_mismatched_inputs_with_a_reason():
    x = torch.randn(1, 8)
    with pytest.raises(RuntimeError, match="must match"):
        torch.ops.hf_moe.linear_infer(x, torch.randn(4, 8, dtype=torch.bfloat16), None, None)
    with pytest.raises(RuntimeError, match="needs its fp32 scales"):
        torch.ops.hf_moe.linear_infer(x, torch.zeros(4, 8, dtype=torch.int8), None, None)
    with pytest.raises(RuntimeError, match="inputs"):
        torch.ops.hf_moe.linear_infer(x, torch.randn(4, 9), None, None)


def test_linear_layers_and_experts_check_int8_scales_in_one_place():
    """A linear layer's [O, K] and experts' [E, O, K] int8 weights are read through one view, checked by one function
    (csrc weight_view): the same fault in their scales gets the same words from linear_infer and moe_experts_infer."""
    x = torch.randn(2, 64)
    linear = torch.zeros(4, 64, dtype=torch.int8)
    w1, w2 = torch.zeros(2, 8, 64, dtype=torch.int8), torch.zeros(2, 64, 4, dtype=torch.int8)
    index, weights = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)

    def experts(w1_scale):
        torch.ops.hf_moe.moe_experts_infer(x, index, weights, w1, w1_scale, None, w2, torch.ones(2, 64), None,
                                           "silu", True)

    groups = "'s scales have 3 groups over 64 inputs; each group must span a multiple of 32 inputs"
    with pytest.raises(RuntimeError, match="linear_infer: the weight" + groups):
        torch.ops.hf_moe.linear_infer(x, linear, torch.ones(4, 3), None)
    with pytest.raises(RuntimeError, match="moe_experts_infer: w1" + groups):
        experts(torch.ones(2, 8, 3))
    shape = r"'s scales must be a contiguous fp32 \[{0}\] or \[{0}, groups\]"
    with pytest.raises(RuntimeError, match="the weight" + shape.format("4")):
        torch.ops.hf_moe.linear_infer(x, linear, torch.ones(5), None)
    with pytest.raises(RuntimeError, match="w1" + shape.format("E, 8")):
        experts(torch.ones(2, 7))


def block_args(dtype, batch=2, hidden=64, q_heads=4, kv_heads=2, head_dim=16, length=32, position=7, bias=True,
               qk_norm=True, int8=False, seed=0):
    """Arguments of decode_attention_block: random weights, a cache already holding `position` positions."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def proj(out, inp):
        w = torch.randn(out, inp, generator=g) * inp ** -0.5
        if int8:
            q, s = quantize_int8(w)
            return q, s, rand(out) if bias else None
        return w.to(dtype), None, rand(out) if bias else None

    freqs = position * 10000 ** (-torch.arange(0, head_dim, 2) / head_dim)
    angles = torch.cat([freqs, freqs])[None].expand(batch, head_dim)
    wq, wk, wv, wo = proj(q_heads * head_dim, hidden), proj(kv_heads * head_dim, hidden), \
        proj(kv_heads * head_dim, hidden), proj(hidden, q_heads * head_dim)
    return dict(
        hidden=rand(batch, hidden, scale=1.0), input_norm=1 + rand(hidden), eps=1e-5,
        wq=wq[0], wq_scale=wq[1], bq=wq[2], wk=wk[0], wk_scale=wk[1], bk=wk[2], wv=wv[0], wv_scale=wv[1], bv=wv[2],
        wo=wo[0], wo_scale=wo[1], bo=None,
        q_norm=1 + rand(head_dim) if qk_norm else None, k_norm=1 + rand(head_dim) if qk_norm else None, qk_eps=1e-6,
        cos=angles.cos().to(dtype).contiguous(), sin=angles.sin().to(dtype).contiguous(),
        k_cache=rand(batch, kv_heads, length, head_dim, scale=1.0),
        v_cache=rand(batch, kv_heads, length, head_dim, scale=1.0),
        position=torch.tensor(position), mask=None, scaling=head_dim ** -0.5, post_norm=1 + rand(hidden),
        post_eps=1e-5,
    )


def run_both(args, kernels="auto"):
    """(kernel outputs, kernel caches), (reference outputs, reference caches), each on its own copy of the caches."""
    mine = dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone())
    theirs = dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone())
    out = torch.ops.hf_moe.decode_attention_block(**mine, kernels=kernels)
    expected = decode_attention_block_reference(**theirs)
    return (out, mine["k_cache"], mine["v_cache"]), (expected, theirs["k_cache"], theirs["v_cache"])


BLOCK_CASES = [  # (kernels, dtype, variant): every variant on the fast kernels in both dtypes, a few AVX2 (the
    # fast ones of a CPU without AVX-512) and portable
    *[("auto", dtype, variant) for dtype in (torch.float32, torch.bfloat16)
      for variant in ("llama", "qwen2_bias", "qwen3_qk_norm", "int8", "padded", "mha_long")],
    ("avx2", torch.float32, "mha_long"), ("avx2", torch.bfloat16, "mha_long"), ("avx2", torch.bfloat16, "padded"),
    ("avx2", torch.float32, "wide_head"), ("avx2", torch.bfloat16, "wide_head"), ("auto", torch.bfloat16, "wide_head"),
    ("portable", torch.float32, "padded"), ("portable", torch.bfloat16, "qwen3_qk_norm"),
    ("portable", torch.bfloat16, "int8"),
]


@pytest.mark.parametrize("kernels,dtype,variant", BLOCK_CASES)
def test_decode_attention_block_matches_the_reference(kernels, dtype, variant):
    kwargs = dict(bias=variant == "qwen2_bias", qk_norm=variant == "qwen3_qk_norm", int8=variant == "int8")
    if variant == "mha_long":  # as many kv heads as q heads; a cache long enough for several chunks per head
        kwargs.update(kv_heads=4, length=300, position=250)
    if variant == "wide_head":  # 74 = 64 + 8 + 2: every column loop of the kernels that weigh the value rows
        kwargs.update(head_dim=74, length=40, position=30)
    args = block_args(dtype, **kwargs)
    if variant == "padded":  # left padding: row 0's first three positions are masked, and a free slot past the end
        mask = torch.arange(args["k_cache"].shape[2])[None].expand(2, -1) <= 7
        mask = mask.clone()
        mask[0, :3] = False
        args["mask"] = mask
    (out, k, v), (expected, k_ref, v_ref) = run_both(args, kernels)
    for a, b in zip(out, expected):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **tolerance(dtype))
    # The cache: this token's k and v at the position, as the reference writes them; nothing else touched.
    torch.testing.assert_close(k, k_ref, **tolerance(dtype))
    torch.testing.assert_close(v, v_ref, **tolerance(dtype))
    untouched = torch.ones(k.shape[2], dtype=torch.bool)
    untouched[{"mha_long": 250, "wide_head": 30}.get(variant, 7)] = False
    assert torch.equal(k[:, :, untouched], args["k_cache"][:, :, untouched])


def test_decode_attention_block_bf16_rounds_where_the_eager_model_rounds():
    """bf16: the kernel rounds each intermediate where the eager model rounds it, so it lands on the reference's
    bf16 values far more often than the same maths in fp32 rounded once at the end; the cache entries (rounded
    q/k/v, rotary embedding) are the reference's exactly."""
    for seed in range(3):
        args = block_args(torch.bfloat16, batch=1, bias=False, qk_norm=False, seed=seed)
        (out, k, v), (expected, k_ref, v_ref) = run_both(args)
        fp32 = {name: value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
                for name, value in args.items()}
        rounded_once = decode_attention_block_reference(**dict(fp32, k_cache=fp32["k_cache"].clone(),
                                                               v_cache=fp32["v_cache"].clone()))
        for mine, at_the_end, eager in zip(out, rounded_once, expected):
            same = (mine == eager).float().mean()
            assert same > (at_the_end.bfloat16() == eager).float().mean() + 0.1 and same > 0.7, same
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_decode_attention_block_refuses_a_full_cache():
    args = block_args(torch.float32, position=32)
    with pytest.raises(RuntimeError, match="cache is full"):
        torch.ops.hf_moe.decode_attention_block(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_is_dequantize_then_matmul_and_passes_gradients(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 24).to(dtype)
    q = QuantizedLinear.from_linear(linear)
    assert q.weight.dtype == torch.int8 and q.weight_scale.dtype == torch.float32 and q.bias.dtype == dtype
    q = q.to(dtype)  # the scales stay fp32
    assert q.weight_scale.dtype == torch.float32
    x = torch.randn(3, 5, 64).to(dtype)
    reference = torch.nn.functional.linear(x, q.dequantized(dtype), q.bias)
    with torch.no_grad():
        torch.testing.assert_close(q(x), reference, **tolerance(dtype))
    # with a gradient: the dequantized weight, so the input's gradient flows (LoRA on the layers before it)
    x.requires_grad_(True)
    q(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    # and int8 keeps the layer's answer: within 1% of the full-precision product
    with torch.no_grad():
        full = linear(x)
        assert (q(x) - full).norm() / full.norm() < 0.01
