"""The Triton kernels op by op against the pure-torch reference: routing (sort by expert), permute and unpermute,
the grouped GEMM (forward, dX, weight gradient), the activations, the GPU block sizes and the autotuner, in fp32 and
bf16. They run under the interpreter or on a GPU; tests/triton_support.py says how."""

from __future__ import annotations

import pytest
import torch
from triton_support import (
    DEVICE,
    KERNELS_RUN_HERE,
    SMALL_GEMM,
    SMALL_WEIGHT_GRAD,
    _index,
    _launch_table,  # noqa: F401 (autouse fixture)
    _no_fallback,  # noqa: F401 (autouse fixture)
    _tol,
    kernels,
)

from hf_moe.ops import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.oldest]

if KERNELS_RUN_HERE:
    from hf_moe.ops.triton import activation as act_k
    from hf_moe.ops.triton import grouped_gemm as gemm_k
    from hf_moe.ops.triton import permute as perm_k
    from hf_moe.ops.triton import routing as route_k
    from hf_moe.ops.triton.runtime import launch_counts
    from test_ops import CASES

DTYPES = [torch.float32, torch.bfloat16]
ROUTING_CASES = CASES + [(40, 3, 37, "random")] if KERNELS_RUN_HERE else []  # E + 1 > the scan's bucket tile


@kernels
@pytest.mark.parametrize("n,k,e,mode", ROUTING_CASES)
def test_sort_by_expert(n, k, e, mode):
    index, _ = _index(n, k, e, mode)
    for idx in (index, index.int()):
        got = route_k.sort_by_expert(idx, e)
        for a, b in zip(got, ref.sort_by_expert(idx, e)):
            assert a.dtype == b.dtype and torch.equal(a, b)


@kernels
@pytest.mark.gpu_smoke
@pytest.mark.memcheck
def test_sort_by_expert_with_gpu_blocks_and_no_pairs():
    index, _ = _index(300, 2, 6, "dropped")  # 600 slots: several 128-slot blocks
    got = route_k.sort_by_expert(index, 6, route_k.GPU_BLOCKS)
    assert all(torch.equal(a, b) for a, b in zip(got, ref.sort_by_expert(index, 6)))
    empty = route_k.sort_by_expert(index[:0], 6)
    assert [t.shape[0] for t in empty] == [0, 0, 6] and not empty[2].any()


@kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k,e,mode", [
    pytest.param(*case, marks=pytest.mark.memcheck) if case[3] == "dropped" else case
    for case in (CASES if KERNELS_RUN_HERE else [])])
def test_permute_and_unpermute(n, k, e, mode, dtype):
    index, weights = _index(n, k, e, mode)
    sorted_slots, slot_to_row, _ = ref.sort_by_expert(index, e)
    x = torch.randn(24, n, dtype=dtype, device=DEVICE).t()  # non-contiguous [n, 24]
    assert torch.equal(perm_k.permute(x, sorted_slots, k), ref.permute(x, sorted_slots, k))
    rows = torch.randn(n * k, 40, dtype=dtype, device=DEVICE)[:, ::2]  # non-contiguous [M, 20]
    w = weights.to(dtype).t().contiguous().t()  # non-contiguous [n, k]
    for weights_ in (None, w):
        torch.testing.assert_close(perm_k.unpermute(rows, slot_to_row, weights_, k),
                                   ref.unpermute(rows, slot_to_row, weights_, k), **_tol(dtype))


# Every routing in fp32; bf16 on the two that stress the groups most (empty experts, dropped rows).
GEMM_CASES = [("random", torch.float32), ("skewed", torch.float32), ("one_expert", torch.float32),
              ("dropped", torch.float32), ("skewed", torch.bfloat16), ("dropped", torch.bfloat16)]


def _gemm_cases(*dropped_marks):
    """GEMM_CASES, with `dropped_marks` on the dropped rows (the cases gpu_check runs under --smoke or memcheck)."""
    return [pytest.param(*case, marks=dropped_marks) if case[0] == "dropped" else case for case in GEMM_CASES]


@kernels
@pytest.mark.parametrize("mode,dtype", _gemm_cases(pytest.mark.gpu_smoke, pytest.mark.memcheck),
                         ids=lambda v: str(v).replace("torch.", ""))
def test_grouped_mm_forward_and_dx(mode, dtype):
    """Forward with bias and the routing-weight bias scale, with and without the gather inside the GEMM; dX (not transposed);
    weights given transposed (non-contiguous)."""
    n, k, e, a, b = 21, 2, 6, 40, 24  # 42 rows, out 40 and in 24: no multiple of the 16-row blocks
    index, _ = _index(n, k, e, mode)
    sorted_slots, _, counts = ref.sort_by_expert(index, e)
    opts = dict(dtype=dtype, device=DEVICE)
    tokens = torch.randn(n, b, **opts)
    x = ref.permute(tokens, sorted_slots, k)
    weight = torch.randn(e, b, a, **opts).transpose(1, 2)  # [E, A, B], non-contiguous
    bias, scale = torch.randn(e, a, **opts), torch.rand(n * k, **opts)
    for bias_, scale_ in ((None, None), (bias, None), (bias, scale)):
        want = ref.grouped_mm(x, weight, counts, bias_, scale_, True)
        got = gemm_k.grouped_mm(x, weight, counts, bias_, scale_, True, config=SMALL_GEMM)
        torch.testing.assert_close(got, want, **_tol(dtype))
        gathered = gemm_k.grouped_mm(tokens, weight, counts, bias_, scale_, True, sorted_slots, k, config=SMALL_GEMM)
        assert torch.equal(gathered, got)
    g = torch.randn(n * k, a, **opts)
    torch.testing.assert_close(gemm_k.grouped_mm(g, weight, counts, None, None, False, config=SMALL_GEMM),
                               ref.grouped_mm(g, weight, counts, None, None, False), **_tol(dtype))


@kernels
@pytest.mark.parametrize("mode,dtype", _gemm_cases(pytest.mark.memcheck), ids=lambda v: str(v).replace("torch.", ""))
def test_grouped_mm_weight_grad(mode, dtype):
    n, k, e, a, b = 21, 2, 6, 40, 24
    index, _ = _index(n, k, e, mode)
    sorted_slots, _, counts = ref.sort_by_expert(index, e)
    opts = dict(dtype=dtype, device=DEVICE)
    grad_tokens, x_tokens = torch.randn(n, a, **opts), torch.randn(n, b, **opts)
    g, x = ref.permute(grad_tokens, sorted_slots, k), ref.permute(x_tokens, sorted_slots, k)
    want = ref.grouped_mm_weight_grad(g, x, counts)
    got = gemm_k.grouped_mm_weight_grad(g, x, counts, config=SMALL_WEIGHT_GRAD)
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert torch.equal(gemm_k.grouped_mm_weight_grad(grad_tokens, x, counts, sorted_slots, k, "grad_out",
                                                     config=SMALL_WEIGHT_GRAD), got)
    assert torch.equal(gemm_k.grouped_mm_weight_grad(g, x_tokens, counts, sorted_slots, k, "x",
                                                     config=SMALL_WEIGHT_GRAD), got)
    ones = torch.ones(n * k, 1, **opts)  # the bias gradient's [M, 1] operand
    torch.testing.assert_close(gemm_k.grouped_mm_weight_grad(g, ones, counts, config=SMALL_WEIGHT_GRAD),
                               ref.grouped_mm_weight_grad(g, ones, counts), **_tol(dtype))
    if mode in ("skewed", "one_expert"):
        assert not got[counts == 0].any()  # experts without rows: zero gradient


@kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("glu", [True, False])
@pytest.mark.parametrize("activation", [pytest.param("silu", marks=pytest.mark.memcheck), "gelu", "gelu_tanh", "relu",
                                        "relu2"])
def test_activation_forward_and_backward(activation, glu, dtype):
    m, width = 37, 20  # neither a multiple of the 16-row / 16-column blocks
    opts = dict(dtype=dtype, device=DEVICE)
    h = torch.randn(m, 3 * width if glu else 2 * width, **opts)[:, : 2 * width if glu else width]  # non-contiguous
    grad = torch.randn(m, width, **opts)
    for scale in (None, torch.rand(m, **opts)):
        torch.testing.assert_close(act_k.expert_act(h, scale, activation, glu),
                                   ref.expert_act(h, scale, activation, glu), **_tol(dtype))
        for return_output in (False, True):
            got = act_k.expert_act_backward(grad, h, scale, activation, glu, return_output)
            want = ref.expert_act_backward(grad, h, scale, activation, glu, return_output)
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.dtype == b.dtype
                torch.testing.assert_close(a, b, **_tol(dtype))


@kernels
def test_gpu_block_sizes_on_small_shapes():
    """The GPU configs (every autotune config of both GEMMs for fp32, and the other kernels' blocks) on small shapes.
    fp32 sums of 136 products in another order: 1e-5 relative."""
    tol = dict(rtol=1e-5, atol=1e-4)
    n, k, e, h, inter = 70, 2, 4, 136, 72  # 140 rows > a 128-row tile, H > 128 columns
    index, weights = _index(n, k, e, "dropped")
    sorted_slots, slot_to_row, counts = ref.sort_by_expert(index, e)
    x = torch.randn(n, h, device=DEVICE)
    rows = ref.permute(x, sorted_slots, k)
    assert torch.equal(perm_k.permute(x, sorted_slots, k, perm_k.GPU_BLOCKS), rows)
    torch.testing.assert_close(perm_k.unpermute(rows, slot_to_row, weights.float(), k, perm_k.GPU_BLOCKS),
                               ref.unpermute(rows, slot_to_row, weights.float(), k))
    hh, scale = torch.randn(n * k, 2 * inter, device=DEVICE), torch.rand(n * k, device=DEVICE)
    torch.testing.assert_close(act_k.expert_act(hh, scale, "silu", True, act_k.GPU_BLOCKS),
                               ref.expert_act(hh, scale, "silu", True))
    grad = torch.randn(n * k, inter, device=DEVICE)
    for a, b in zip(act_k.expert_act_backward(grad, hh, scale, "silu", True, True, act_k.GPU_BLOCKS),
                    ref.expert_act_backward(grad, hh, scale, "silu", True, True)):
        torch.testing.assert_close(a, b)
    w = torch.randn(e, 2 * inter, h, device=DEVICE)
    want = ref.grouped_mm(rows, w, counts, None, None, True)
    from hf_moe.ops.triton.configs import configs_for

    for config in configs_for("grouped_mm", x.dtype):  # the configs a GPU would launch for fp32 (at this precision)
        meta = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
        torch.testing.assert_close(gemm_k.grouped_mm(x, w, counts, None, None, True, sorted_slots, k, config=meta),
                                   want, **tol)
    g = torch.randn(n * k, 2 * inter, device=DEVICE)
    want = ref.grouped_mm_weight_grad(g, rows, counts)
    for config in configs_for("weight_grad", x.dtype):
        meta = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
        torch.testing.assert_close(gemm_k.grouped_mm_weight_grad(g, x, counts, sorted_slots, k, "x", config=meta),
                                   want, **tol)


@kernels
def test_autotuner_path():
    """The GPU launch path: triton.autotune over the sm90 configs (timed on the host under the interpreter, so its
    choice means nothing here), with the EVEN_K heuristic, then the chosen config's launch."""
    n, k, e, h, inter = 40, 2, 4, 64, 48
    index, _ = _index(n, k, e, "random")
    sorted_slots, _, counts = ref.sort_by_expert(index, e)
    x, w = torch.randn(n, h, device=DEVICE), torch.randn(e, 2 * inter, h, device=DEVICE)
    got = gemm_k.grouped_mm(x, w, counts, None, None, True, sorted_slots, k, config="autotune")
    torch.testing.assert_close(got, ref.grouped_mm(ref.permute(x, sorted_slots, k), w, counts, None, None, True))
    g = torch.randn(n * k, 2 * inter, device=DEVICE)
    got = gemm_k.grouped_mm_weight_grad(g, x, counts, sorted_slots, k, "x", config="autotune")
    torch.testing.assert_close(got, ref.grouped_mm_weight_grad(g, ref.permute(x, sorted_slots, k), counts))


@kernels
def test_torch_grouped_mm_is_called_where_usable(monkeypatch):
    """Where `torch_grouped_mm_usable` says so, the op permutes (if gathering) and calls torch's grouped_mm path
    (`reference.grouped_mm`) instead of the Triton GEMM."""
    n, k, e = 20, 2, 4
    index, _ = _index(n, k, e, "skewed")
    sorted_slots, _, counts = ref.sort_by_expert(index, e)
    x, w = torch.randn(n, 16, device=DEVICE), torch.randn(e, 24, 16, device=DEVICE)
    calls = []
    monkeypatch.setattr(gemm_k, "torch_grouped_mm_usable", lambda *a, **kw: True)
    monkeypatch.setattr(gemm_k, "torch_grouped_mm", lambda *a: calls.append("mm") or ref_grouped_mm(*a))
    monkeypatch.setattr(gemm_k, "torch_grouped_mm_weight_grad", lambda *a: calls.append("dw") or ref_weight_grad(*a))
    before = dict(launch_counts)
    got = gemm_k.grouped_mm(x, w, counts, None, None, True, sorted_slots, k)
    dw = gemm_k.grouped_mm_weight_grad(torch.randn(n * k, 24, device=DEVICE), x, counts, sorted_slots, k, "x")
    assert calls == ["mm", "dw"] and dw.shape == (e, 24, 16)
    assert launch_counts["_grouped_mm_kernel"] == before.get("_grouped_mm_kernel", 0)
    assert launch_counts["_permute_kernel"] == before.get("_permute_kernel", 0) + 2
    torch.testing.assert_close(got, ref_grouped_mm(ref.permute(x, sorted_slots, k), w, counts, None, None, True))
    calls.clear()  # torch_gemm=False: the Triton kernel all the same (how gpu_check tests it on sm90 in bf16)
    own = gemm_k.grouped_mm(x, w, counts, None, None, True, sorted_slots, k, torch_gemm=False)
    torch.testing.assert_close(own, got)
    assert calls == [] and launch_counts["_grouped_mm_kernel"] > before.get("_grouped_mm_kernel", 0)


ref_grouped_mm, ref_weight_grad = ref.grouped_mm, ref.grouped_mm_weight_grad
