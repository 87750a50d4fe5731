"""The compiled inference kernel `hf_moe::moe_experts_infer` (csrc/cpu/infer_cpu.cpp, infer_kernels.cpp and
infer_kernels_q8.cpp) against the pure-torch reference: fp32, bf16 and int8 (dequantize-then-matmul) weights, fp32
and bf16 activations, every kernel set (AVX-512 BF16 where the CPU has it, AVX2 with FMA, and the portable C++ one),
on the routing edge cases of test_ops.py."""

from __future__ import annotations

import pytest
import torch

from hf_moe.ops import REFERENCE, _compiled, experts_forward, load_extension, use_backend
from hf_moe.ops import reference as ref
from hf_moe.ops.experts import run_experts
from hf_moe.ops.int8 import dequantize_int8, quantize_int8
from conftest import cpu_has_avx2_fma
from test_ops import _Experts, _routing

pytestmark = pytest.mark.usefixtures("two_threads")  # the kernels' split of rows over threads
ACTIVATIONS = ["silu", "gelu", "gelu_tanh", "relu", "relu2"]


@pytest.fixture(scope="module")
def compiled():
    ops = _compiled()
    assert ops is not None, f"the compiled extension is unavailable: {load_extension()[1].how}"
    return ops


# "auto": the kernels this CPU runs by default (AVX-512 BF16 where present, else AVX2 where present); "avx2" and
# "portable": the kernels of CPUs without AVX-512 BF16 or without AVX2, run here on a subset of the cases.
KERNEL_SETS = ["auto", "avx2", "portable"]


@pytest.fixture(autouse=True)
def _kernel_set_runs_here(request):
    """Skips the "avx2" cases on a CPU without AVX2 and FMA (where the op refuses the name)."""
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("kernels") == "avx2" and not cpu_has_avx2_fma():
        pytest.skip("this CPU has no AVX2 with FMA")


def _weights(e, hidden, inter, glu, bias, seed=1):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(e, 2 * inter if glu else inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(e, hidden, inter, generator=g) / inter**0.5
    b1 = torch.randn(e, w1.shape[1], generator=g) * 0.1 if bias else None
    b2 = torch.randn(e, hidden, generator=g) * 0.1 if bias else None
    return w1, b1, w2, b2


def _oracle(x, index, weights, w1, b1, w2, b2, activation, glu, round_a, round_out):
    """The reference computation in fp64 of the values the kernel multiplies (x, weights and biases as given),
    rounding to bf16 where the kernel does: the activations `a` before the second product when it computes in bf16,
    the output when it is bf16."""
    d = torch.float64
    k = index.shape[1]
    sorted_slots, slot_to_row, counts = ref.sort_by_expert(index, w1.shape[0])
    row_weight = weights.double().reshape(-1).index_select(0, sorted_slots)
    rows = ref.permute(x.double(), sorted_slots, k)
    h = ref.grouped_mm(rows, w1.to(d), counts, None if b1 is None else b1.to(d), None, True)
    a = ref.expert_act(h, row_weight, activation, glu)
    if round_a:
        a = a.bfloat16().double()
    y = ref.grouped_mm(a, w2.to(d), counts, None if b2 is None else b2.to(d), row_weight if b2 is not None else None, True)
    out = ref.unpermute(y, slot_to_row, None, k)
    return out.bfloat16().double() if round_out else out


def _close(got, want, bf16):
    scale = want.abs().max().item() + 1e-6
    # fp32: summation order only. bf16: the kernel's fp32 sums of bf16 products can round a and the output the
    # other way at a tie: one bf16 step (2^-8 relative) on a few elements.
    tol = 2**-7 if bf16 else 2e-6
    torch.testing.assert_close(got.double(), want, atol=tol * scale, rtol=tol)


CASES = [
    # (tokens, k, experts, routing, hidden, intermediate): hidden/intermediate not multiples of 16 or 32 test the
    # kernels' masked tails; more than 4 rows per expert tests the row tiles.
    (1, 2, 4, "random", 64, 96),
    (3, 2, 5, "random", 80, 48),
    (37, 2, 8, "skewed", 128, 160),
    (16, 2, 6, "one_expert", 40, 72),
    (10, 4, 4, "random", 96, 64),
    (30, 2, 5, "dropped", 64, 96),
    # 16 rows or more per expert take the GEMM kernels (packed activations): 70 rows on expert 0 and 1 make row
    # blocks of 32, 32 and 6; an odd intermediate size leaves an unpaired input in bf16.
    (70, 2, 3, "one_expert", 40, 45),
    (5, 2, 4, "random", 128, 192),  # groups of 64 over whole cache lines of int8 weights
]
WEIGHTS = ["fp32", "bf16", "int8", "int8_group32", "int8_group64"]


def _prepared(kind, w1, w2, hidden, inter):
    """(w1, s1, w2, s2) as the kernel takes them, and the weights it multiplies by (dequantized)."""
    if kind == "fp32":
        return (w1, None, w2, None), (w1, w2)
    if kind == "bf16":
        w1, w2 = w1.bfloat16(), w2.bfloat16()
        return (w1, None, w2, None), (w1, w2)
    group = int(kind.removeprefix("int8_group")) if kind.startswith("int8_group") else None
    if group and (hidden % group or inter % group):
        pytest.skip("grouped scales need group-aligned sizes")
    q1, s1 = quantize_int8(w1, group)
    q2, s2 = quantize_int8(w2, group)
    return (q1, s1, q2, s2), (dequantize_int8(q1, s1), dequantize_int8(q2, s2))


def _subset(cases, kernels):
    return [pytest.param(*case, kernels, id="-".join(map(str, case)) + f"-{kernels}") for case in cases]


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", WEIGHTS)
@pytest.mark.parametrize(
    "n,k,e,mode,hidden,inter,glu,bias,kernels",
    [(*case, glu, bias, "auto") for case in CASES for glu, bias in [(True, False), (False, True), (True, True)]]
    + [case for kernels in ("avx2", "portable") for case in _subset(
        [(*CASES[0], True, False), (*CASES[2], True, True), (*CASES[3], False, True), (*CASES[6], True, True)],
        kernels)],
)
def test_infer_matches_reference(n, k, e, mode, hidden, inter, glu, bias, kind, x_dtype, kernels, compiled):
    """moe_experts_infer equals the reference computation on the values it multiplies: for int8 weights, that is
    dequantize-then-matmul. (With bf16 activations the oracle takes the dequantized weights as bf16, which is what
    an expert's GEMM multiplies; an expert with few rows multiplies q * scale in fp32, within the bf16 tolerance.)"""
    index, weights = _routing(n, k, e, mode)
    weights = weights.float()
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(2)).to(x_dtype)
    w1, b1, w2, b2 = _weights(e, hidden, inter, glu, bias)
    args, (d1, d2) = _prepared(kind, w1, w2, hidden, inter)
    bf16 = kind == "bf16" or (kind.startswith("int8") and x_dtype == torch.bfloat16)
    xm = x.bfloat16() if bf16 else x.float()
    if bf16:
        d1, d2 = d1.bfloat16(), d2.bfloat16()
    w1_, s1, w2_, s2 = args
    out = torch.ops.hf_moe.moe_experts_infer(x, index, weights, w1_, s1, b1, w2_, s2, b2, "silu", glu, kernels)
    assert out.dtype == x_dtype and out.shape == x.shape
    round_out = x_dtype == torch.bfloat16
    _close(out, _oracle(xm, index, weights, d1, b1, d2, b2, "silu", glu, bf16, round_out), bf16 or round_out)


@pytest.mark.parametrize("kernels", ["avx2", "portable"])
def test_a_prefill_of_int8_experts_in_bf16_computes_in_fp32_without_bf16_instructions(kernels, compiled):
    """Where the CPU has no bf16 instructions (the avx2 and portable kernel sets), an expert's GEMM of bf16
    activations and int8 weights runs in fp32 (faster there than widening bf16 pairs): the weights dequantized in
    fp32 and the activations between the two products kept in fp32, so the result is nearer the fp32 computation of
    the same inputs than the bf16 one (weights and activations rounded to bf16), element by element on average."""
    index, weights = _routing(70, 2, 3, "one_expert")  # 70 rows on two experts: the GEMM kernels
    weights = weights.float()
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    w1, b1, w2, b2 = _weights(3, 64, 96, True, False)
    (q1, s1, q2, s2), (d1, d2) = _prepared("int8", w1, w2, 64, 96)
    out = torch.ops.hf_moe.moe_experts_infer(x, index, weights, q1, s1, b1, q2, s2, b2, "silu", True, kernels)
    out = out.double()
    in_fp32 = _oracle(x, index, weights, d1, b1, d2, b2, "silu", True, False, False)
    in_bf16 = _oracle(x, index, weights, d1.bfloat16(), b1, d2.bfloat16(), b2, "silu", True, True, False)
    assert (out - in_fp32).abs().mean() < 0.5 * (out - in_bf16).abs().mean()


@pytest.mark.parametrize("kernels", KERNEL_SETS)
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("hidden,inter", [(13, 61), (14, 62), (17, 59), (20, 56), (23, 45), (27, 68)])
def test_gemm_outputs_do_not_depend_on_the_register_tile_they_fall_in(hidden, inter, kind, kernels, compiled):
    """Experts with 16 rows or more take the GEMM kernels, which compute a few weight rows at a time in register tiles
    of several widths (the avx2 set: 12 rows per call, in tiles of six and what is left; 8 as 4 + 4). These sizes leave
    tiles of every width in both products, and an odd input count in the second. Each output equals the reference,
    and sums its products in one order whatever tile it falls in: with w2's rows (the hidden columns) reversed, the
    output is the same columns reversed, bit for bit."""
    index, weights = _routing(40, 2, 3, "one_expert")  # 40 rows on experts 0 and 1: three 16-row panels each
    weights = weights.float()
    x = torch.randn(40, hidden, generator=torch.Generator().manual_seed(2))
    w1, b1, w2, b2 = _weights(3, hidden, inter, True, False)
    (w1_, s1, w2_, s2), (d1, d2) = _prepared(kind, w1, w2, hidden, inter)
    bf16 = kind == "bf16"
    x = x.bfloat16() if bf16 else x
    if bf16:
        d1, d2 = d1.bfloat16(), d2.bfloat16()

    def run(w2_, s2):
        return torch.ops.hf_moe.moe_experts_infer(x, index, weights, w1_, s1, None, w2_, s2, None, "silu", True,
                                                  kernels)

    out = run(w2_, s2)
    _close(out, _oracle(x, index, weights, d1, None, d2, None, "silu", True, bf16, bf16), bf16)
    flipped = run(w2_.flip(1).contiguous(), None if s2 is None else s2.flip(1).contiguous())
    assert torch.equal(flipped.flip(1), out)


@pytest.mark.parametrize("kernels", KERNEL_SETS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_infer_every_activation(activation, kind, kernels, compiled):
    index, weights = _routing(9, 2, 4, "random")
    weights = weights.float()
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2)) * 2  # wide enough to reach the tails
    w1, b1, w2, b2 = _weights(4, 64, 96, True, True)
    (w1_, s1, w2_, s2), (d1, d2) = _prepared(kind, w1, w2, 64, 96)
    bf16 = kind == "bf16"
    if bf16:
        x = x.bfloat16()
    out = torch.ops.hf_moe.moe_experts_infer(x, index, weights, w1_, s1, b1, w2_, s2, b2, activation, True, kernels)
    _close(out, _oracle(x, index, weights, d1, b1, d2, b2, activation, True, bf16, bf16), bf16)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int8_group32"])
def test_a_token_gets_the_same_bits_alone_or_in_a_batch(kind, compiled):
    """A decode step (one row per expert: the kernels read the weight rows one after the other) and a batch of up to
    4 rows per expert (a register tile over the rows side by side) sum each row in the same order: equal bits. The
    sizes leave masked tails."""
    hidden, inter = (96, 128) if kind == "int8_group32" else (80, 112)
    x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(2))
    x = x.bfloat16() if kind == "bf16" else x
    index = torch.tensor([[0, 2]] * 4)
    weights = torch.tensor([[0.7, 0.3]] * 4)
    w1, b1, w2, b2 = _weights(3, hidden, inter, True, False)
    (w1, s1, w2, s2), _ = _prepared(kind, w1, w2, hidden, inter)
    batch = torch.ops.hf_moe.moe_experts_infer(x, index, weights, w1, s1, b1, w2, s2, b2, "silu", True)
    for t in range(4):
        alone = torch.ops.hf_moe.moe_experts_infer(x[t:t + 1], index[t:t + 1], weights[t:t + 1], w1, s1, b1, w2, s2,
                                                   b2, "silu", True)
        assert torch.equal(alone[0], batch[t]), t


def test_avx512_and_portable_kernels_agree(compiled):
    if torch.ops.hf_moe.infer_isa() != "avx512_bf16":
        pytest.skip("this CPU has no AVX-512 BF16: only the portable kernels run")
    index, weights = _routing(33, 2, 8, "random")
    x = torch.randn(33, 96)
    w1, b1, w2, b2 = _weights(8, 96, 160, True, True)
    q1, s1 = quantize_int8(w1)
    q2, s2 = quantize_int8(w2)
    for args in [(x, w1, None, w2, None), (x.bfloat16(), w1.bfloat16(), None, w2.bfloat16(), None), (x, q1, s1, q2, s2)]:
        xx, a1, c1, a2, c2 = args
        fast = torch.ops.hf_moe.moe_experts_infer(xx, index, weights.float(), a1, c1, b1, a2, c2, b2, "silu", True)
        slow = torch.ops.hf_moe.moe_experts_infer(xx, index, weights.float(), a1, c1, b1, a2, c2, b2, "silu", True,
                                                  "portable")
        bf16 = xx.dtype == torch.bfloat16
        torch.testing.assert_close(fast.float(), slow.float(), rtol=2**-7 if bf16 else 1e-5, atol=2**-7 if bf16 else 1e-5)


def _one_value_each(gate: torch.Tensor, activation: str, routing: float, kernels: str) -> torch.Tensor:
    """The experts op on one token whose gate values are `gate` [H] as they are: an identity gate projection, an up
    projection of bias 1, an identity down projection, routed to the one expert with weight `routing`. So output c
    is act(gate[c]) * 1 * routing, with nothing added but exact zeros, and each value shows the kernels' activation
    (and in bf16, their rounding of it) alone."""
    h, dtype = gate.numel(), gate.dtype
    w1 = torch.cat([torch.eye(h), torch.zeros(h, h)])[None].to(dtype)
    b1 = torch.cat([torch.zeros(h), torch.ones(h)])[None]
    w2 = torch.eye(h)[None].to(dtype)
    return torch.ops.hf_moe.moe_experts_infer(gate[None], torch.zeros(1, 1, dtype=torch.long),
                                              torch.tensor([[routing]]), w1, None, b1, w2, None, None, activation,
                                              True, kernels)[0]


@pytest.mark.parametrize("kernels", KERNEL_SETS)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "relu", "relu2"])
def test_activations_out_to_where_e_to_the_x_overflows(activation, kernels, compiled):
    """The vectorized activations (their own e^x, in the AVX2 and AVX-512 sets) against fp64, value by value, from
    where e^x underflows to where it overflows, on a length that leaves a tail of every kernel's lanes."""
    ends = [-100.0, -88.5, -88.37, -87.4, -87.3, -50.0, -1e-3, 0.0, 1e-3, 50.0, 87.3, 87.4, 88.37, 88.5, 100.0]
    gate = torch.tensor(ends + torch.linspace(-12, 12, 16).tolist())  # 31 values
    g = gate.double()
    expected = {"silu": lambda: g / (1 + torch.exp(-g)), "relu": lambda: torch.relu(g),
                "relu2": lambda: torch.relu(g) ** 2,
                "gelu_tanh": lambda: g / (1 + torch.exp(-2 * 0.7978845608028654 * (g + 0.044715 * g**3)))}[activation]()
    # silu of -100 is -3.7e-42; a kernel's e^x stops at the largest float (-4e-37) or overflows (-0): atol takes both.
    # GELU's 0.5 g (1 + tanh(y)) is g sigmoid(2y), the form the vectorized kernels and fp64 here compute; the portable
    # kernel's 1 + tanh(y) in fp32 loses a small result's digits to cancellation.
    portable = kernels == "portable" or torch.ops.hf_moe.infer_isa() == "portable"
    atol = 1e-6 if activation == "gelu_tanh" and portable else 1e-30
    torch.testing.assert_close(_one_value_each(gate, activation, 1.0, kernels).double(), expected, rtol=2e-6,
                               atol=atol)


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_bf16_rounding_breaks_ties_to_even(kernels, compiled):
    """A bf16 value (8 significant bits) times 1.5 has 9: about half of them are an exact tie between two bf16 values,
    and the kernels must round every one to the even one, as torch's .to(torch.bfloat16) does (here: the activations
    before the down projection, which then passes them through exactly)."""
    gate = (torch.randn(203, generator=torch.Generator().manual_seed(3)).abs() * 1e3).bfloat16()
    exact = gate.float() * 1.5
    assert (exact.view(torch.int32) & 0xFFFF == 0x8000).sum() > 50  # the ties are there
    assert torch.equal(_one_value_each(gate, "relu", 1.5, kernels), exact.bfloat16())


def test_infer_no_tokens_and_all_dropped(compiled):
    w1, b1, w2, b2 = _weights(4, 32, 32, True, True)
    empty = torch.ops.hf_moe.moe_experts_infer(torch.zeros(0, 32), torch.zeros(0, 2, dtype=torch.long),
                                               torch.zeros(0, 2), w1, None, b1, w2, None, b2, "silu", True)
    assert empty.shape == (0, 32)
    dropped = torch.ops.hf_moe.moe_experts_infer(torch.randn(3, 32), torch.full((3, 2), -1), torch.ones(3, 2),
                                                 w1, None, b1, w2, None, b2, "silu", True)
    assert torch.equal(dropped, torch.zeros(3, 32))


def test_infer_errors_name_the_fix(compiled):
    w1, _, w2, _ = _weights(4, 64, 64, True, False)
    x, index, weights = torch.randn(2, 64), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)
    q1, s1 = quantize_int8(w1)
    q2, s2 = quantize_int8(w2)
    op = torch.ops.hf_moe.moe_experts_infer
    with pytest.raises(RuntimeError, match="w1 is int8 and needs its fp32 scales"):
        op(x, index, weights, q1, None, None, q2, s2, None, "silu", True)
    with pytest.raises(RuntimeError, match="w1 is Float but w2 is Char"):
        op(x, index, weights, w1, None, None, q2, s2, None, "silu", True)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(x, index, weights, q1, torch.ones(4, 128, 4), None, q2, s2, None, "silu", True)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        op(x.double(), index, weights, w1.double(), None, None, w2.double(), None, None, "silu", True)
    with pytest.raises(RuntimeError, match="unknown kernel set"):
        op(x, index, weights, w1, None, None, w2, None, None, "silu", True, "sse2")


def _ran(fn, name="hf_moe::moe_experts_infer"):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, any(evt.key == name for evt in prof.key_averages())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_dispatch_takes_the_inference_kernel(dtype, compiled):
    """Inference on few tokens (decoding) runs moe_experts_infer where the CPU has AVX-512 BF16 or AVX2, with the
    numbers of the whole-layer training op; with gradients, or in fp64, that op runs as before."""
    from hf_moe.ops import infer

    experts = _Experts(4, 64, 48, glu=True, bias=True, dtype=dtype)
    index, weights = _routing(2, 2, 4, "random")
    x = torch.randn(2, 64, dtype=dtype)
    with use_backend("compiled"):
        with torch.no_grad():
            out, ran = _ran(lambda: experts_forward(experts, x, index, weights.to(dtype)))
        assert ran == (infer.kernel_isa() in ("avx512_bf16", "avx2")
                       and (infer.max_tokens(dtype) is None or x.shape[0] <= infer.max_tokens(dtype)))
        bf16 = dtype == torch.bfloat16
        want = _oracle(x, index, weights.to(dtype), *(t.detach() for t in (experts.gate_up_proj,
                       experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)), "silu", True, bf16, bf16)
        if ran:
            _close(out, want, bf16)
        _, ran_with_grad = _ran(lambda: experts_forward(experts, x, index, weights.to(dtype)))
        assert not ran_with_grad


@pytest.mark.compile
def test_torch_compile_traces_the_inference_kernel(compiled):
    """Under torch.compile(fullgraph=True) a decode-sized inference call is one opaque node with a shape function."""
    experts = _Experts(4, 64, 48, glu=True, bias=False, dtype=torch.float32).requires_grad_(False)
    index, weights = _routing(1, 2, 4, "random")
    x = torch.randn(1, 64)

    def layer(x, index, weights):
        return experts_forward(experts, x, index, weights) * 2

    with use_backend("compiled"), torch.no_grad():
        want = layer(x, index, weights.float())
        got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, index, weights.float())
    torch.testing.assert_close(got, want)
