"""Every hf_moe op has a decomposition into standard ATen ops (hf_moe/ops/decompositions.py), registered where
`torch.onnx.export` looks for them: it equals the op (values), has the op's output metadata (shapes, dtypes,
contiguous strides: FakeTensor takes them from it under symbolic sizes), and an exported program decomposed with it
holds no hf_moe op. The ONNX conversions themselves are in test_onnx.py."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import hf_moe  # noqa: F401  (defines the ops and registers their decompositions)
from hf_moe.ops import library
from hf_moe.ops.decompositions import DECOMPOSITIONS
from hf_moe.ops.int8 import quantize_int8
from hf_moe.ops.triton import ops as triton_ops

N, K, E, H, I = 5, 2, 4, 8, 6


def _inputs(glu: bool, bias: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    index = torch.randint(0, E, (N, K), generator=g)
    index[1, 0] = E  # a dropped pair: no expert
    w = torch.rand(N, K, generator=g).to(dtype)
    w1 = randn(E, 2 * I if glu else I, H)
    return dict(x=randn(N, H), index=index, w=w, w1=w1, b1=randn(E, w1.shape[1]) if bias else None,
                w2=randn(E, H, I), b2=randn(E, H) if bias else None)


def _calls(glu: bool, bias: bool):
    """(op name, args) for every op of the hf_moe namespace, on consistent inputs."""
    t = _inputs(glu, bias)
    act = "silu" if glu else "gelu"
    sorted_slots, slot_to_row, counts = torch.ops.hf_moe.sort_by_expert(t["index"], E)
    row_weight = t["w"].reshape(-1).index_select(0, sorted_slots)
    rows = torch.ops.hf_moe.permute(t["x"], sorted_slots, K)
    h = torch.ops.hf_moe.grouped_mm(rows, t["w1"], counts, t["b1"], None, True)
    grad_a = torch.randn(N * K, I)
    q1, s1 = quantize_int8(t["w1"])
    q2, s2 = quantize_int8(t["w2"], group_size=None)
    params = (t["w1"], t["b1"], t["w2"], t["b2"])
    return [
        ("sort_by_expert", (t["index"], E)),
        ("permute", (t["x"], sorted_slots, K)),
        ("unpermute", (torch.randn(N * K, H), slot_to_row, t["w"], K)),
        ("unpermute", (torch.randn(N * K, H), slot_to_row, None, K)),
        ("grouped_mm", (rows, t["w1"], counts, t["b1"], row_weight if bias else None, True)),
        ("grouped_mm", (torch.randn(N * K, H), t["w2"], counts, None, None, False)),
        ("grouped_mm_weight_grad", (torch.randn(N * K, 3), rows, counts)),
        ("expert_act", (h, row_weight, act, glu)),
        ("expert_act_backward", (grad_a, h, row_weight, act, glu, True)),
        ("moe_experts_forward", (t["x"], t["index"], t["w"], *params, act, glu, True)),
        ("moe_experts_forward", (t["x"], t["index"], t["w"], *params, act, glu, False)),
        ("moe_experts_backward", (torch.randn(N, H), t["x"], h, sorted_slots, slot_to_row, counts, row_weight,
                                  *params, act, glu, True, True, True)),
        ("moe_experts_infer", (t["x"], t["index"], t["w"], t["w1"], None, t["b1"], t["w2"], None, t["b2"], act, glu)),
        ("moe_experts_infer", (t["x"], t["index"], t["w"], q1, s1, t["b1"], q2, s2, t["b2"], act, glu)),
    ]


def _check(op, decomposition, args, reference=None, what=""):
    want = (reference or op)(*args)
    got = decomposition(*args)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    fake = fake if isinstance(fake, tuple) else (fake,)
    assert len(got) == len(want) == len(fake), what
    for i, (g, w, f) in enumerate(zip(got, want, fake)):
        assert (g.shape, g.dtype, g.stride()) == (f.shape, f.dtype, f.stride()), f"{what} output {i}: metadata"
        if w.numel():  # (an empty output is the op's "not asked for")
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"{what} output {i}")


@pytest.mark.parametrize("glu,bias", [(True, True), (False, False)])
def test_each_hf_moe_op_equals_its_decomposition(glu, bias):
    table = torch._decomp.decomposition_table
    for name, args in _calls(glu, bias):
        op = getattr(torch.ops.hf_moe, name).default
        assert op in table, f"hf_moe::{name} has no decomposition"
        _check(op, table[op], args, what=f"hf_moe::{name}")


def test_every_op_of_every_hf_moe_namespace_is_decomposed():
    """A new op without a decomposition fails here: the exporters would meet it untranslated."""
    table = torch._decomp.decomposition_table
    expected = {f"hf_moe::{name}" for name in library.SCHEMAS}
    expected |= {"hf_moe_torch::grouped_mm", "hf_moe_torch::grouped_mm_weight_grad"}
    expected |= {f"hf_moe_triton::{name}" for name in DECOMPOSITIONS if hasattr(torch.ops.hf_moe_triton, name)}
    assert len(expected) == len(library.SCHEMAS) + 2 + 9
    assert {op.name() for op in table if op.name().startswith("hf_moe")} == expected


def test_torch_and_triton_namespace_ops_equal_their_decompositions():
    """hf_moe_torch's loops (run), and hf_moe_triton's ops against their pure-torch fallbacks (the Triton kernels
    need a GPU), with the permute the Triton GEMMs fuse."""
    table = torch._decomp.decomposition_table
    t = _inputs(True, True)
    sorted_slots, _, counts = torch.ops.hf_moe.sort_by_expert(t["index"], E)
    rows = torch.ops.hf_moe.permute(t["x"], sorted_slots, K)
    scale = torch.rand(N * K)
    for name, args in [("grouped_mm", (rows, t["w1"], counts, t["b1"], scale, True)),
                       ("grouped_mm_weight_grad", (torch.randn(N * K, 3), rows, counts))]:
        op = getattr(torch.ops.hf_moe_torch, name).default
        _check(op, table[op], args, what=f"hf_moe_torch::{name}")
    triton = torch.ops.hf_moe_triton
    gathered = (t["x"], t["w1"], counts, t["b1"], scale, True, sorted_slots, K)
    _check(triton.grouped_mm.default, table[triton.grouped_mm.default], gathered,
           reference=triton_ops._torch_gathered_mm, what="hf_moe_triton::grouped_mm")
    for gather, a, b in [("grad_out", torch.randn(N, 3), rows), ("x", torch.randn(N * K, 3), t["x"])]:
        args = (a, b, counts, sorted_slots, K, gather)
        _check(triton.grouped_mm_weight_grad.default, table[triton.grouped_mm_weight_grad.default], args,
               reference=triton_ops._torch_weight_grad, what=f"hf_moe_triton::grouped_mm_weight_grad {gather}")
    forward = (t["x"], t["index"], t["w"], t["w1"], t["b1"], t["w2"], t["b2"], "silu", True, True)
    _check(triton.moe_experts_forward.default, table[triton.moe_experts_forward.default], forward,
           reference=torch.ops.hf_moe.moe_experts_forward.default, what="hf_moe_triton::moe_experts_forward")


def _decode_calls():
    """(op name, args) for the decode step's ops (hf_moe/ops/decode.py): fp32 and int8 weights (a scale per row, per
    group), with and without bias, a mask or not, Qwen3's q/k norms; grouped-query heads on a static cache."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    x, w, bias = randn(3, 64), randn(12, 64), randn(12)
    row, group = quantize_int8(w, group_size=None), quantize_int8(w, group_size=32)
    calls = [("linear_infer", (x, w, None, bias)), ("linear_infer", (x, *row, None)),
             ("linear_infer", (x, *group, bias))]
    batch, hidden, q_heads, kv_heads, head_dim, length = 2, 16, 4, 2, 4, 6
    angles = randn(batch, head_dim)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, :2] = False  # a left-padded row
    for int8, qk_norm, with_mask in [(False, False, False), (True, True, True)]:
        def proj(out, inp):
            weight = randn(out, inp) * inp ** -0.5
            return (*quantize_int8(weight), randn(out)) if int8 else (weight, None, None)

        args = (randn(batch, hidden), 1 + randn(hidden), 1e-5, *proj(q_heads * head_dim, hidden),
                *proj(kv_heads * head_dim, hidden), *proj(kv_heads * head_dim, hidden),
                *proj(hidden, q_heads * head_dim), 1 + randn(head_dim) if qk_norm else None,
                1 + randn(head_dim) if qk_norm else None, 1e-6, angles.cos(), angles.sin(),
                randn(batch, kv_heads, length, head_dim), randn(batch, kv_heads, length, head_dim),
                torch.tensor(3), mask if with_mask else None, head_dim ** -0.5, 1 + randn(hidden), 1e-5)
        calls.append(("decode_attention_block", args))
    return calls


def test_decode_ops_equal_their_decompositions():
    """linear_infer and decode_attention_block (which writes the caches in place: op and decomposition write the
    same values at the same position, so the second call reads what the first left)."""
    table = torch._decomp.decomposition_table
    for name, args in _decode_calls():
        op = getattr(torch.ops.hf_moe, name).default
        assert op in table, f"hf_moe::{name} has no decomposition"
        _check(op, table[op], args, what=f"hf_moe::{name}")


class _Layer(torch.nn.Module):
    def __init__(self, op, quantized: bool):
        super().__init__()
        t = _inputs(True, False)
        self.op, self.quantized = op, quantized
        self.w1, self.w2 = torch.nn.Parameter(t["w1"]), torch.nn.Parameter(t["w2"])
        if quantized:
            (self.q1, self.s1), (self.q2, self.s2) = quantize_int8(t["w1"]), quantize_int8(t["w2"])

    def forward(self, x, index, weights):
        if self.op == "infer":
            w1, s1, w2, s2 = (self.q1, self.s1, self.q2, self.s2) if self.quantized else (self.w1, None, self.w2, None)
            return torch.ops.hf_moe.moe_experts_infer(x, index, weights, w1, s1, None, w2, s2, None, "silu", True)
        return torch.ops.hf_moe.moe_experts_forward(x, index, weights, self.w1, None, self.w2, None, "silu", True,
                                                    torch.is_grad_enabled())[0]


@pytest.mark.compile
@pytest.mark.parametrize("op,quantized,grad", [("infer", True, False), ("forward", False, True)])
def test_exported_program_decomposes_to_aten_only(op, quantized, grad):
    """torch.export keeps the op as one node (a saved program runs our kernels); the decomposition table turns it
    into ATen ops, with symbolic token counts and, with gradients on, the training variant (save_h) of the op."""
    layer = _Layer(op, quantized)
    t = _inputs(True, False)
    args = (t["x"], t["index"], t["w"])
    tokens = torch.export.Dim("tokens", min=2, max=64)
    with torch.set_grad_enabled(grad):
        program = torch.export.export(layer, args, dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert any(target.startswith("hf_moe.") for target in targets), targets
    ours = {op: fn for op, fn in torch._decomp.decomposition_table.items() if op.name().startswith("hf_moe")}
    decomposed = program.run_decompositions(ours)
    targets = {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    assert not [target for target in targets if "hf_moe" in target], targets
    assert "aten.sort.stable" not in targets
    with torch.no_grad():
        for n in (5, 9):
            x, index, weights = torch.randn(n, H), torch.randint(0, E, (n, K)), torch.rand(n, K)
            torch.testing.assert_close(decomposed.module()(x, index, weights), layer(x, index, weights),
                                       rtol=1e-5, atol=1e-5)
