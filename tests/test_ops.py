"""The pure-torch dispatch ops against a token-by-token loop, forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN

from hf_moe.ops import expert_histogram, experts_forward, grouped_linear, permute, sort_by_expert, unpermute


class _Experts(nn.Module):
    """A bare experts module in transformers' layout, for driving `experts_forward` directly."""

    def __init__(self, num_experts, hidden, inter, glu=True, bias=False, dtype=torch.float32):
        super().__init__()
        self.num_experts, self.has_gate, self.act_fn = num_experts, glu, ACT2FN["silu" if glu else "gelu_new"]
        up = 2 * inter if glu else inter
        g = torch.Generator().manual_seed(1)
        first = nn.Parameter(torch.randn(num_experts, up, hidden, generator=g, dtype=dtype) * 0.2)
        self.gate_up_proj, self.up_proj = (first, None) if glu else (None, first)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, inter, generator=g, dtype=dtype) * 0.2)
        bias_up = nn.Parameter(torch.randn(num_experts, up, generator=g, dtype=dtype)) if bias else None
        self.gate_up_proj_bias, self.up_proj_bias = (bias_up, None) if glu else (None, bias_up)
        self.down_proj_bias = nn.Parameter(torch.randn(num_experts, hidden, generator=g, dtype=dtype)) if bias else None


def _naive(experts: _Experts, x, index, weights):
    """One token, one slot at a time: the definition of the MoE output."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = index[n, j]
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
    if mode == "random":
        index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    elif mode == "one_expert":  # every token's first choice is expert 0; experts > k get nothing
        index = torch.arange(k).expand(n, k).clone()
    elif mode == "skewed":  # only experts 0..k
        index = torch.stack([torch.randperm(k + 1, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
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
]


@pytest.mark.parametrize("glu,bias", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("n,k,e,mode", CASES)
def test_experts_forward_matches_token_loop(n, k, e, mode, glu, bias):
    experts = _Experts(e, 12, 10, glu=glu, bias=bias).double()
    x = torch.randn(n, 12, dtype=torch.float64)
    index, weights = _routing(n, k, e, mode)
    weights = weights.double()
    ours = _grads(lambda x, w: experts_forward(experts, x, index, w), experts, x, weights)
    ref = _grads(lambda x, w: _naive(experts, x, index, w), experts, x, weights)
    for a, b in zip(ours[:3], ref[:3]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for name in ref[3]:
        torch.testing.assert_close(ours[3][name], ref[3][name], rtol=1e-10, atol=1e-10, msg=name)


def test_non_contiguous_input():
    experts = _Experts(4, 12, 10).double()
    base = torch.randn(12, 20, dtype=torch.float64)
    x = base.t()[:, :12]  # [20, 12], non-contiguous
    assert not x.is_contiguous()
    index, weights = _routing(20, 2, 4, "random")
    out = experts_forward(experts, x, index, weights.double())
    torch.testing.assert_close(out, _naive(experts, x.contiguous(), index, weights.double()))


def test_bf16_close_to_fp32():
    experts = _Experts(4, 16, 8)
    x = torch.randn(40, 16)
    index, weights = _routing(40, 2, 4, "random")
    ref = experts_forward(experts, x, index, weights)
    low = experts_forward(experts.to(torch.bfloat16), x.bfloat16(), index, weights.bfloat16())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, rtol=5e-2, atol=5e-2)


def test_gradcheck_components():
    torch.manual_seed(0)
    n, k, e, h = 5, 2, 3, 4
    index, _ = _routing(n, k, e, "random")
    sorted_slots, slot_to_row, counts = sort_by_expert(index, e)
    x = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    w = torch.rand(n, k, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(e, 3, h, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(e, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: permute(x, sorted_slots, slot_to_row, k), (x,))
    rows = torch.randn(n * k, h, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r, w: unpermute(r, sorted_slots, slot_to_row, w), (rows, w))
    assert torch.autograd.gradcheck(lambda r, wt, b: grouped_linear(r, wt, counts, b), (rows, weight, bias))


def test_sort_by_expert_is_stable_and_groups_experts():
    index = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    sorted_slots, slot_to_row, counts = sort_by_expert(index, 4)
    assert counts.tolist() == [3, 2, 3, 0]
    assert index.view(-1)[sorted_slots].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert sorted_slots.tolist() == [1, 2, 6, 3, 5, 0, 4, 7]  # slot order kept inside an expert
    assert torch.equal(sorted_slots[slot_to_row], torch.arange(8))


def test_histogram_ignores_out_of_range_ids():
    index = torch.tensor([[0, 3], [1, -1], [4, 0]])  # -1 and 4 are "dropped" sentinels for E=4
    assert expert_histogram(index, 4).tolist() == [2, 1, 0, 1]


def test_grouped_linear_zeroes_rows_past_the_groups():
    x = torch.randn(6, 4)
    weight = torch.randn(2, 3, 4)
    out = grouped_linear(x, weight, torch.tensor([2, 1]))
    assert torch.equal(out[3:], torch.zeros(3, 3))
    torch.testing.assert_close(out[:2], x[:2] @ weight[0].t())
    torch.testing.assert_close(out[2:3], x[2:3] @ weight[1].t())
