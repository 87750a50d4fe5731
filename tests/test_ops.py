"""Dispatch ops: both implementations against a token-by-token loop, and the compiled kernels op by op against
the pure-torch reference, forward and backward, in fp64, fp32 and bf16, on the edge cases that break dispatch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN

from hf_moe.ops import REFERENCE, _compiled, dispatch_ops, experts_forward, load_extension, use_backend
from hf_moe.ops import reference as ref
from hf_moe.ops.experts import run_experts

DEVICES = ["cpu"]  # the compiled ops are C++ for CPU; CUDA runs torch ops (default) or Triton (tests/test_triton.py)


@pytest.fixture(scope="module")
def compiled():
    ops = _compiled()
    assert ops is not None, f"the compiled extension is unavailable: {load_extension()[1].how}"
    return ops


class _Experts(nn.Module):
    """A bare experts module in transformers' layout, for driving `experts_forward` directly."""

    def __init__(self, num_experts, hidden, inter, glu=True, bias=False, activation=None, dtype=torch.float64):
        super().__init__()
        self.num_experts, self.has_gate = num_experts, glu
        self.activation = activation or ("silu" if glu else "gelu_new")
        self.act_fn = ACT2FN[self.activation]
        up = 2 * inter if glu else inter
        g = torch.Generator().manual_seed(1)
        first = nn.Parameter(torch.randn(num_experts, up, hidden, generator=g, dtype=dtype) * 0.3)
        self.gate_up_proj, self.up_proj = (first, None) if glu else (None, first)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, inter, generator=g, dtype=dtype) * 0.3)
        bias_up = nn.Parameter(torch.randn(num_experts, up, generator=g, dtype=dtype)) if bias else None
        self.gate_up_proj_bias, self.up_proj_bias = (bias_up, None) if glu else (None, bias_up)
        self.down_proj_bias = nn.Parameter(torch.randn(num_experts, hidden, generator=g, dtype=dtype)) if bias else None


def _naive(experts: _Experts, x, index, weights):
    """One token, one slot at a time: the definition of the MoE output. Ids outside [0, E) contribute nothing."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[n, j])
            if not 0 <= e < experts.num_experts:
                continue
            if experts.has_gate:
                h = experts.gate_up_proj[e] @ x[n]
                if experts.gate_up_proj_bias is not None:
                    h = h + experts.gate_up_proj_bias[e]
                gate, up = h.chunk(2)
                h = experts.act_fn(gate) * up
            else:
                h = experts.up_proj[e] @ x[n]
                if experts.up_proj_bias is not None:
                    h = h + experts.up_proj_bias[e]
                h = experts.act_fn(h)
            y = experts.down_proj[e] @ h
            if experts.down_proj_bias is not None:
                y = y + experts.down_proj_bias[e]
            out[n] = out[n] + weights[n, j] * y
    return out


def _routing(n, k, e, mode, seed=0):
    g = torch.Generator().manual_seed(seed)
    if mode in ("random", "dropped"):
        index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
        if mode == "dropped":  # capacity drops: ids -1 or E
            index[:: 3, 0] = -1
            index[1:: 4, -1] = e
    elif mode == "one_expert":  # every token's first choice is expert 0; experts beyond k get nothing
        index = torch.arange(k).expand(n, k).clone()
    elif mode == "skewed":  # only experts 0..k
        index = torch.stack([torch.randperm(k + 1, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g, dtype=torch.float64)
    return index, weights / weights.sum(-1, keepdim=True)


def _grads(fn, experts, x, weights):
    x = x.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    experts.zero_grad()
    out = fn(x, weights)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype))
    return out.detach(), x.grad, weights.grad, {k: p.grad.clone() for k, p in experts.named_parameters()}


CASES = [
    # (tokens, k, experts, routing)
    (32, 2, 4, "random"),
    (32, 2, 8, "skewed"),  # experts that receive no tokens
    (16, 2, 6, "one_expert"),  # every token on expert 0 (and 1)
    (1, 2, 4, "random"),  # a single token
    (10, 4, 4, "random"),  # k == E
    (24, 1, 3, "random"),
    (30, 2, 5, "dropped"),  # pairs dropped by capacity
]


@pytest.mark.parametrize("backend", ["torch", "compiled"])
@pytest.mark.parametrize("glu,bias", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("n,k,e,mode", CASES)
def test_experts_forward_matches_token_loop(n, k, e, mode, glu, bias, backend, compiled):
    experts = _Experts(e, 12, 10, glu=glu, bias=bias)
    x = torch.randn(n, 12, dtype=torch.float64)
    index, weights = _routing(n, k, e, mode)
    with use_backend(backend):
        ours = _grads(lambda x, w: experts_forward(experts, x, index, w), experts, x, weights)
    want = _grads(lambda x, w: _naive(experts, x, index, w), experts, x, weights)
    for a, b in zip(ours[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for name in want[3]:
        torch.testing.assert_close(ours[3][name], want[3][name], rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("backend", ["torch", "compiled"])
@pytest.mark.parametrize("activation", ["gelu", "gelu_pytorch_tanh", "relu", "relu2", "quick_gelu"])
def test_every_activation(activation, backend, compiled):
    # quick_gelu has no compiled kernel: the compiled backend runs it through the pure-torch activation.
    experts = _Experts(4, 8, 6, glu=activation != "relu2", activation=activation)
    x = torch.randn(20, 8, dtype=torch.float64)
    index, weights = _routing(20, 2, 4, "random")
    with use_backend(backend):
        ours = _grads(lambda x, w: experts_forward(experts, x, index, w), experts, x, weights)
    want = _grads(lambda x, w: _naive(experts, x, index, w), experts, x, weights)
    for a, b in zip(ours[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", ["torch", "compiled"])
def test_non_contiguous_input(backend, compiled):
    experts = _Experts(4, 12, 10)
    x = torch.randn(12, 20, dtype=torch.float64).t()  # [20, 12], non-contiguous
    assert not x.is_contiguous()
    index, weights = _routing(20, 2, 4, "random")
    with use_backend(backend):
        out = experts_forward(experts, x, index[:, :], weights.t().contiguous().t())
    torch.testing.assert_close(out, _naive(experts, x.contiguous(), index, weights))


@pytest.mark.parametrize("backend", ["torch", "compiled"])
def test_bf16_close_to_fp32(backend, compiled):
    experts = _Experts(4, 16, 8, dtype=torch.float32)
    x = torch.randn(40, 16)
    index, weights = _routing(40, 2, 4, "random")
    with use_backend(backend):
        want = experts_forward(experts, x, index, weights.float())
        low = experts_forward(experts.to(torch.bfloat16), x.bfloat16(), index, weights.bfloat16())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), want, rtol=5e-2, atol=5e-2)


def test_gradcheck_reference_composition():
    experts = _Experts(3, 4, 3, glu=True, bias=True)
    index, weights = _routing(5, 2, 3, "random")
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = weights.clone().requires_grad_(True)
    params = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)

    def f(x, w, w1, b1, w2, b2):
        return run_experts(REFERENCE, x, index, w, w1, b1, w2, b2, "silu", True)

    assert torch.autograd.gradcheck(f, (x, w, *params))


# -- the compiled ops, one by one, against the reference ----------------------------------------------------------
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def _tol(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,e,mode", CASES)
def test_compiled_dispatch_ops_match_reference(n, k, e, mode, dtype, device, compiled):
    index, weights = _routing(n, k, e, mode)
    index = index.to(device)
    got = compiled.sort_by_expert(index, e)
    want = ref.sort_by_expert(index, e)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    sorted_slots, slot_to_row, counts = want
    x = torch.randn(n, 24, dtype=dtype, device=device)
    assert torch.equal(compiled.permute(x, sorted_slots, k), ref.permute(x, sorted_slots, k))
    rows = torch.randn(n * k, 24, dtype=dtype, device=device)
    for w in (None, weights.to(device=device, dtype=dtype)):
        torch.testing.assert_close(
            compiled.unpermute(rows, slot_to_row, w, k), ref.unpermute(rows, slot_to_row, w, k), **_tol(dtype)
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["random", "skewed", "dropped"])
def test_compiled_grouped_mm_matches_reference(mode, dtype, device, compiled):
    n, k, e, a, b = 40, 2, 6, 16, 24
    index, _ = _routing(n, k, e, mode)
    _, _, counts = ref.sort_by_expert(index.to(device), e)
    opts = dict(dtype=dtype, device=device)
    x = torch.randn(n * k, b, **opts)
    weight = torch.randn(e, a, b, **opts)
    bias = torch.randn(e, a, **opts)
    scale = torch.rand(n * k, **opts)
    for bias_, scale_ in ((None, None), (bias, None), (bias, scale)):
        torch.testing.assert_close(
            compiled.grouped_mm(x, weight, counts, bias_, scale_, True),
            ref.grouped_mm(x, weight, counts, bias_, scale_, True),
            **_tol(dtype),
        )
    g = torch.randn(n * k, a, **opts)
    torch.testing.assert_close(
        compiled.grouped_mm(g, weight, counts, None, None, False), ref.grouped_mm(g, weight, counts, None, None, False),
        **_tol(dtype),
    )
    torch.testing.assert_close(
        compiled.grouped_mm_weight_grad(g, x, counts), ref.grouped_mm_weight_grad(g, x, counts), **_tol(dtype)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu", "relu2"])
@pytest.mark.parametrize("glu", [True, False])
def test_compiled_activation_matches_reference(activation, glu, dtype, device, compiled):
    m, width = 50, 14
    opts = dict(dtype=dtype, device=device)
    h = torch.randn(m, 2 * width if glu else width, **opts)
    grad = torch.randn(m, width, **opts)
    for scale in (None, torch.rand(m, **opts)):
        torch.testing.assert_close(
            compiled.expert_act(h, scale, activation, glu), ref.expert_act(h, scale, activation, glu), **_tol(dtype)
        )
        for return_output in (False, True):
            got = compiled.expert_act_backward(grad, h, scale, activation, glu, return_output)
            want = ref.expert_act_backward(grad, h, scale, activation, glu, return_output)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, **_tol(dtype))
            if return_output:
                torch.testing.assert_close(want[2], ref.expert_act(h, scale, activation, glu))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("glu,bias", [(True, False), (False, True)])
def test_compiled_experts_forward_backward_match_reference(glu, bias, dtype, device, compiled):
    """The whole-layer CPU op (one call forward, one backward), against the reference."""
    experts = _Experts(5, 16, 12, glu=glu, bias=bias, dtype=dtype).to(device)
    x = torch.randn(30, 16, dtype=dtype, device=device)
    index, weights = _routing(30, 2, 5, "dropped")
    index, weights = index.to(device), weights.to(device=device, dtype=dtype)
    assert dispatch_ops(x.device, "silu").name.startswith("compiled")
    with use_backend("compiled"):
        got = _grads(lambda x, w: experts_forward(experts, x, index, w), experts, x, weights)
    with use_backend("torch"):
        want = _grads(lambda x, w: experts_forward(experts, x, index, w), experts, x, weights)
    tol = dict(rtol=5e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, **tol)
    for name in want[3]:
        torch.testing.assert_close(got[3][name], want[3][name], **tol, msg=name)


def test_reference_sort_is_stable_and_groups_experts():
    index = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    sorted_slots, slot_to_row, counts = ref.sort_by_expert(index, 4)
    assert counts.tolist() == [3, 2, 3, 0]
    assert index.view(-1)[sorted_slots].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert sorted_slots.tolist() == [1, 2, 6, 3, 5, 0, 4, 7]  # slot order kept inside an expert
    assert torch.equal(sorted_slots[slot_to_row], torch.arange(8))


def test_reference_sort_puts_dropped_pairs_last():
    index = torch.tensor([[0, 3], [1, -1], [4, 0]])  # -1 and 4 are dropped for E=4
    sorted_slots, _, counts = ref.sort_by_expert(index, 4)
    assert counts.tolist() == [2, 1, 0, 1]
    assert sorted_slots.tolist()[-2:] == [3, 4]


def test_reference_grouped_mm_zeroes_rows_past_the_groups():
    x = torch.randn(6, 4)
    weight = torch.randn(2, 3, 4)
    out = ref.grouped_mm(x, weight, torch.tensor([2, 1]), None, None, True)
    assert torch.equal(out[3:], torch.zeros(3, 3))
    torch.testing.assert_close(out[:2], x[:2] @ weight[0].t())
    torch.testing.assert_close(out[2:3], x[2:3] @ weight[1].t())


@pytest.mark.compile
@pytest.mark.slow
def test_torch_compile_traces_the_compiled_ops(compiled):
    from hf_moe import MoEConfig, SparseMoeBlock
    from transformers import LlamaConfig

    base = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)
    block = SparseMoeBlock(MoEConfig.from_base(base, num_experts=4, num_experts_per_tok=2))
    x = torch.randn(2, 7, 32, requires_grad=True)
    compiled_block = torch.compile(block, backend="aot_eager", fullgraph=False)
    with use_backend("compiled"):
        want = block(x)
        got = compiled_block(x)
        torch.testing.assert_close(got, want)
        (gx,) = torch.autograd.grad(got.sum(), x)
        (wx,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(gx, wx)


@pytest.mark.parametrize("backend", ["torch", "compiled"])
def test_no_tokens_at_all(backend, compiled):
    """An expert-parallel rank can receive no rows: forward and backward of an empty batch must work."""
    experts = _Experts(4, 12, 10, glu=True, bias=True)
    x = torch.zeros(0, 12, dtype=torch.float64, requires_grad=True)
    index = torch.zeros(0, 2, dtype=torch.long)
    weights = torch.zeros(0, 2, dtype=torch.float64, requires_grad=True)
    with use_backend(backend):
        out = experts_forward(experts, x, index, weights)
        assert out.shape == (0, 12)
        out.sum().backward()
    assert experts.down_proj.grad.abs().sum() == 0 and x.grad.shape == (0, 12)


# -- torch's grouped_mm path (the default on CUDA in bf16 on sm90), forced here with a stand-in --------------------
def _nan_filling_grouped_mm(a, b, offs=None, **_):
    """torch.nn.functional.grouped_mm as the GPU leaves it: the rows past the last group hold whatever the allocator
    had (here NaN). 2-D x 3-D: [M, K] x [E, K, N] -> [M, N]; 2-D x 2-D (weight gradients): [A, M] x [M, B] ->
    [E, A, B], zero for empty groups (as on sm90)."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = torch.full((a.shape[0], b.shape[-1]), float("nan"), dtype=a.dtype)
        for e, (s, t) in enumerate(zip(starts, ends)):
            out[s:t] = a[s:t] @ b[e]
        return out
    return torch.stack([a[:, s:t] @ b[s:t] for s, t in zip(starts, ends)])


@pytest.mark.parametrize("glu,bias", [(True, False), (False, True)])
def test_grouped_mm_path_is_nan_safe_with_dropped_pairs(monkeypatch, glu, bias):
    """torch's grouped_mm leaves the rows of dropped pairs unwritten; a 0/1 mask kept their NaN (NaN * 0 = NaN), which
    reached the output, grad_x and the routing weights' gradient. Forced path, forward and backward, against the
    token loop."""
    monkeypatch.setattr(ref, "_use_grouped_mm", lambda *args: True)
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", _nan_filling_grouped_mm, raising=False)
    experts = _Experts(5, 12, 10, glu=glu, bias=bias)
    x = torch.randn(30, 12, dtype=torch.float64)
    index, weights = _routing(30, 2, 5, "dropped")
    with use_backend("torch"):
        got = _grads(lambda x, w: experts_forward(experts, x, index, w), experts, x, weights)
    want = _grads(lambda x, w: _naive(experts, x, index, w), experts, x, weights)
    out, grad_x, grad_weights, grad_params = got
    assert all(t.isfinite().all() for t in (out, grad_x, grad_weights, *grad_params.values()))
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b)
    for name in want[3]:  # grad_w of every expert weight (and bias)
        torch.testing.assert_close(got[3][name], want[3][name], msg=name)


def test_grouped_mm_runs_only_on_sm90():
    """torch's grouped GEMM only where it is its fast path and correct: bf16 on sm90. Not sm100+ (non-zero weight
    gradients for experts without rows, pytorch/pytorch#172439), nor older GPUs (a host-syncing loop). Capabilities
    faked: no GPU here."""
    cuda, bf16, fp32 = torch.device("cuda", 0), torch.bfloat16, torch.float32
    usable = ref.torch_grouped_mm_usable
    assert usable(cuda, (bf16, bf16), (2048, 1536), capability=(9, 0))
    for capability in [(10, 0), (10, 3), (12, 0), (8, 0), (8, 9)]:
        assert not usable(cuda, (bf16, bf16), (2048, 1536), capability=capability), capability
    assert not usable(cuda, (fp32, fp32), (2048, 1536), capability=(9, 0))
    assert not usable(cuda, (bf16, bf16), (2048, 20), capability=(9, 0))  # 16-byte aligned strides only
    assert not usable(torch.device("cpu"), (bf16, bf16), (2048, 1536), capability=(9, 0))
    assert "pytorch/pytorch#172439" in ref.GROUPED_MM_WHY


# -- autocast: what Trainer(bf16=True) runs (fp32 weights, bf16 compute) ---------------------------------------------
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32_x", "bf16_x"])
@pytest.mark.parametrize("backend", ["torch", "compiled"])
def test_autocast_with_fp32_weights(backend, x_dtype, compiled):
    """Under torch.autocast(bfloat16) with fp32 expert weights the experts run in bf16, exactly as on bf16 copies
    of the weights, and the fp32 weights get fp32 gradients (the bf16 ones, cast back)."""
    experts = _Experts(4, 16, 12, glu=True, bias=True, dtype=torch.float32)
    bf16 = _Experts(4, 16, 12, glu=True, bias=True, dtype=torch.float32).to(torch.bfloat16)
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in experts.state_dict().items()})
    x = torch.randn(20, 16, dtype=x_dtype)
    index, weights = _routing(20, 2, 4, "dropped")
    weights = weights.float()
    with use_backend(backend):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _grads(lambda x, w: experts_forward(experts, x, index, w), experts, x, weights)
        want = _grads(lambda x, w: experts_forward(bf16, x.bfloat16(), index, w), bf16, x, weights)
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1].to(x_dtype))
    for name, grad in got[3].items():
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, want[3][name].float(), msg=name)


@pytest.mark.slow
def test_converted_model_trains_under_autocast():
    """A converted model with fp32 weights, a forward and backward under CPU autocast in bf16 (Trainer(bf16=True))."""
    from conftest import random_ids, tiny_dense

    from hf_moe import convert_to_moe

    model = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2).train()
    ids = random_ids(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.loss.isfinite()
    grads = {n: p.grad for n, p in model.named_parameters() if "experts" in n}
    assert grads and all(g is not None and g.dtype == torch.float32 and g.isfinite().all() for g in grads.values())


# -- warm-up ------------------------------------------------------------------------------------------------------
def test_warmup_runs_each_expert_layer_and_leaves_the_model_alone(compiled):
    from conftest import tiny_dense

    from hf_moe import convert_to_moe
    from hf_moe.ops import warmup

    model = convert_to_moe(tiny_dense("llama"), num_experts=4, top_k=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lines = warmup(model, tokens=[16, 64])
    assert len(lines) == 2 and "alike" in lines[0] and "16 tokens x 2 experts, compiled" in lines[0]
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="no experts module"):
        warmup(torch.nn.Linear(3, 3), tokens=4, top_k=1)
