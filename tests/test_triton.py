"""The Triton kernels (the GPU path), executed here: every kernel against the pure-torch reference, forward and
backward, in fp32 and bf16 (fp64 where exactness is the claim), on the cases that break dispatch, and a converted
model's training step on the Triton backend against the torch backend.

How this file runs. Triton binds a kernel to its compiler or to its interpreter when the kernel is defined, from
TRITON_INTERPRET. The suite runs without it and without a GPU, so the kernel tests cannot run in its process:
`test_kernels_under_the_interpreter` re-runs this file in a subprocess with TRITON_INTERPRET=1 and
HF_MOE_BACKEND=triton, where they execute on CPU tensors (and the spawner skips itself). On a GPU, without
TRITON_INTERPRET, the kernel tests run directly on CUDA tensors. The child records how often each kernel launched;
the parent checks that every kernel did and prints the table. Run the child's half alone with

    HF_MOE_BACKEND=triton TRITON_INTERPRET=1 python -m pytest tests/test_triton.py
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_moe.ops import reference as ref
from hf_moe.ops import use_backend

ROOT = Path(__file__).resolve().parents[1]
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRETING
KERNELS_RUN_HERE = INTERPRETING or ON_GPU
DEVICE = "cuda" if ON_GPU else "cpu"
LAUNCHES_FILE = "HF_MOE_TRITON_LAUNCHES"  # env: where the child writes its launch counts

kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="run by test_kernels_under_the_interpreter (TRITON_INTERPRET=1)")
parent_only = pytest.mark.skipif(INTERPRETING, reason="checked by the parent process, without the interpreter")
KERNEL_MODULES = ["routing", "permute", "activation", "grouped_gemm"]

if KERNELS_RUN_HERE:
    from hf_moe.ops.triton import activation as act_k
    from hf_moe.ops.triton import grouped_gemm as gemm_k
    from hf_moe.ops.triton import permute as perm_k
    from hf_moe.ops.triton import routing as route_k
    from hf_moe.ops.triton.runtime import launch_counts
    from test_ops import CASES, _Experts, _naive, _routing

BF16 = dict(rtol=2e-2, atol=2e-2)
SMALL_GEMM = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)  # so small shapes span tiles, groups and K steps
SMALL_WEIGHT_GRAD = dict(BLOCK_P=16, BLOCK_Q=16, BLOCK_K=16)


def _grads(fn, experts, x, weights):
    """(out, grad x, grad weights, {param: grad}) of `fn(x, weights)` under a fixed random output gradient."""
    x = x.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    experts.zero_grad()
    out = fn(x, weights)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out.backward(grad.to(device=out.device, dtype=out.dtype))
    return out.detach(), x.grad, weights.grad, {k: p.grad.clone() for k, p in experts.named_parameters()}


def _tol(dtype):
    return BF16 if dtype == torch.bfloat16 else {}


def _index(n, k, e, mode, seed=0):
    index, weights = _routing(n, k, e, mode, seed)
    return index.to(DEVICE), weights.to(DEVICE)


def all_kernel_names() -> set[str]:
    """Every `@triton.jit` kernel in hf_moe/ops/triton (functions named `_*_kernel`)."""
    names = set()
    for module in KERNEL_MODULES:
        mod = importlib.import_module(f"hf_moe.ops.triton.{module}")
        names |= {name for name, obj in vars(mod).items() if name.endswith("_kernel") and hasattr(obj, "fn")}
    return names


@pytest.fixture(scope="module", autouse=True)
def _launch_table(request):
    """After the module: write the launch counts where the parent asked, and print them."""
    yield
    if not KERNELS_RUN_HERE:
        return
    counts = dict(launch_counts)
    if os.environ.get(LAUNCHES_FILE):
        Path(os.environ[LAUNCHES_FILE]).write_text(json.dumps(counts))
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("\n" + _table(counts))


def _table(counts: dict[str, int], where: str = "interpreter" if INTERPRETING else DEVICE) -> str:
    lines = [f"Triton kernel launches ({where}):"]
    lines += [f"  {name:<34} {n:>6}" for name, n in sorted(counts.items())]
    lines.append(f"  {'all ' + str(len(counts)) + ' kernels':<34} {sum(counts.values()):>6}")
    return "\n".join(lines)


# -- the parent: run the kernel tests under the interpreter, and what needs no kernel -----------------------------
@pytest.mark.slow
@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run in this process")
def test_kernels_under_the_interpreter(tmp_path, capsys):
    launches = tmp_path / "launches.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_MOE_BACKEND": "triton", LAUNCHES_FILE: str(launches)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, f"kernel tests failed:\n{result.stdout[-12000:]}\n{result.stderr[-3000:]}"
    counts = json.loads(launches.read_text())
    missing = all_kernel_names() - {name for name, n in counts.items() if n > 0}
    assert not missing, f"kernels no test launched: {sorted(missing)}"
    summary = [line for line in result.stdout.splitlines() if " passed" in line]
    with capsys.disabled():
        print(f"\n{_table(counts, 'interpreter')}\n  (subprocess, TRITON_INTERPRET=1: "
              f"{summary[-1].strip('= ') if summary else ''})")


@pytest.mark.slow
@parent_only
def test_every_kernel_compiles_for_sm90():
    """The GPU code path through Triton's compiler (no GPU needed): every kernel, the GEMMs in every autotune config,
    to PTX with wgmma for the GEMMs, and ptxas' cubin with no register spills and within sm90's shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "hf_moe.ops.triton.aot"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = [line.split() for line in result.stdout.splitlines()[3:] if line.strip()]
    compiled = {" ".join(row[:-5]): row[-5:] for row in rows}
    from hf_moe.ops.triton import aot

    assert set(compiled) == {label for label, *_ in aot.cases()}, result.stdout
    names = {aot_case[1].fn.__name__ for aot_case in aot.cases()}
    assert names == all_kernel_names()  # every kernel has a case
    for label, (_, regs, spill, shared_kb, wgmma) in compiled.items():
        assert int(spill) == 0, f"{label} spills registers:\n{result.stdout}"
        assert float(shared_kb) <= 227, f"{label} needs more shared memory than sm90 has:\n{result.stdout}"
        assert int(regs) <= 255
        if label.startswith(("grouped_mm", "weight_grad")):
            assert wgmma == "yes", f"{label} does not use wgmma:\n{result.stdout}"


@parent_only
def test_grouped_mm_selection_with_faked_capability():
    """torch's grouped_mm for bf16 on sm90/sm100 with 16-byte aligned dims; the Triton GEMM everywhere else."""
    from hf_moe.ops.triton.grouped_gemm import torch_grouped_mm_usable as usable

    cuda, bf16, fp32 = torch.device("cuda", 0), torch.bfloat16, torch.float32
    assert usable(cuda, (bf16, bf16), (2048, 1536), capability=(9, 0))
    assert usable(cuda, (bf16, bf16), (2048, 1536), capability=(10, 0))
    assert not usable(cuda, (bf16, bf16), (2048, 1536), capability=(8, 0))  # torch's fallback syncs: Triton
    assert not usable(cuda, (bf16, bf16), (2048, 1536), capability=(12, 0))
    assert not usable(cuda, (fp32, fp32), (2048, 1536), capability=(9, 0))
    assert not usable(cuda, (bf16, fp32), (2048, 1536), capability=(9, 0))
    assert not usable(cuda, (bf16, bf16), (2048, 1), capability=(9, 0))  # the [M, 1] bias products
    assert not usable(cuda, (bf16, bf16), (2048, 20), capability=(9, 0))
    assert not usable(torch.device("cpu"), (bf16, bf16), (2048, 1536), capability=(9, 0))


@parent_only
def test_triton_on_cpu_without_the_interpreter_says_what_to_do():
    from hf_moe.ops.triton import status

    usable, why = status("cpu")
    assert not usable and "TRITON_INTERPRET=1" in why
    experts = _experts_module()
    with use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        from hf_moe.ops import experts_forward

        experts_forward(experts, torch.randn(3, 8), torch.tensor([[0, 1]] * 3), torch.rand(3, 2))


@parent_only
def test_env_reports_the_triton_backend():
    """`python -m hf_moe.env` names triton's version and why it does not run here (HF_MOE_BACKEND=torch: no build)."""
    import importlib.metadata

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "hf_moe.env"], cwd=ROOT, env={**env, "HF_MOE_BACKEND": "torch"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    triton_line = next(line for line in lines if line.startswith("triton "))
    assert importlib.metadata.version("triton") in triton_line
    assert ON_GPU or "no CUDA device is visible" in triton_line and "TRITON_INTERPRET=1" in triton_line
    assert any(line.startswith("experts on CUDA") and "HF_MOE_BACKEND=torch" in line for line in lines)


@parent_only
def test_cuda_defaults_to_triton(monkeypatch):
    """On CUDA, auto selects Triton when it can run; otherwise torch with a warning (auto) or an error (compiled).
    Triton's status on CUDA is faked: no GPU here."""
    import hf_moe.ops as ops

    monkeypatch.setattr(ops, "_triton_status", lambda device_type: (True, "faked sm90"))
    for setting in ("auto", "compiled", "triton"):
        monkeypatch.setenv("HF_MOE_BACKEND", setting)
        assert ops._choose("cuda") == "triton"
    monkeypatch.setattr(ops, "_triton_status", lambda device_type: (False, "triton is not installed"))
    monkeypatch.setenv("HF_MOE_BACKEND", "auto")
    with pytest.warns(RuntimeWarning, match="triton is not installed"):
        assert ops._choose("cuda") == "torch"
    monkeypatch.setenv("HF_MOE_BACKEND", "compiled")
    with pytest.raises(RuntimeError, match="HF_MOE_BACKEND=compiled.*triton is not installed"):
        ops._choose("cuda")
    with pytest.raises(RuntimeError, match="runs on CPU tensors, not cuda"):
        ops._variant("compiled", "cuda", "silu")


def _experts_module():
    from hf_moe import MoEConfig
    from hf_moe.layers.experts import Experts
    from transformers import LlamaConfig

    base = LlamaConfig(hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2)
    return Experts(MoEConfig.from_base(base, num_experts=3, num_experts_per_tok=2))


# -- kernels, op by op, against the reference ------------------------------------------------------------------------
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
def test_sort_by_expert_with_gpu_blocks_and_no_pairs():
    index, _ = _index(300, 2, 6, "dropped")  # 600 slots: several 128-slot blocks
    got = route_k.sort_by_expert(index, 6, route_k.GPU_BLOCKS)
    assert all(torch.equal(a, b) for a, b in zip(got, ref.sort_by_expert(index, 6)))
    empty = route_k.sort_by_expert(index[:0], 6)
    assert [t.shape[0] for t in empty] == [0, 0, 6] and not empty[2].any()


@kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k,e,mode", CASES if KERNELS_RUN_HERE else [])
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


@kernels
@pytest.mark.parametrize("mode,dtype", GEMM_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_grouped_mm_forward_and_dx(mode, dtype):
    """Forward with bias and the routing-weight bias scale, with and without the fused gather; dX (not transposed);
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
@pytest.mark.parametrize("mode,dtype", GEMM_CASES, ids=lambda v: str(v).replace("torch.", ""))
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
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu", "relu2"])
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
    """The GPU configs (every autotune config of both GEMMs, and the other kernels' blocks) on small shapes.
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
    for config in gemm_k.SM90_CONFIGS:
        meta = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
        torch.testing.assert_close(gemm_k.grouped_mm(x, w, counts, None, None, True, sorted_slots, k, config=meta),
                                   want, **tol)
    g = torch.randn(n * k, 2 * inter, device=DEVICE)
    want = ref.grouped_mm_weight_grad(g, rows, counts)
    for config in gemm_k.SM90_WEIGHT_GRAD_CONFIGS:
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
    monkeypatch.setattr(gemm_k.reference, "grouped_mm", lambda *a: calls.append("mm") or ref_grouped_mm(*a))
    monkeypatch.setattr(gemm_k.reference, "grouped_mm_weight_grad",
                        lambda *a: calls.append("dw") or ref_weight_grad(*a))
    before = dict(launch_counts)
    got = gemm_k.grouped_mm(x, w, counts, None, None, True, sorted_slots, k)
    dw = gemm_k.grouped_mm_weight_grad(torch.randn(n * k, 24, device=DEVICE), x, counts, sorted_slots, k, "x")
    assert calls == ["mm", "dw"] and dw.shape == (e, 24, 16)
    assert launch_counts["_grouped_mm_kernel"] == before.get("_grouped_mm_kernel", 0)
    assert launch_counts["_permute_kernel"] == before.get("_permute_kernel", 0) + 2
    torch.testing.assert_close(got, ref_grouped_mm(ref.permute(x, sorted_slots, k), w, counts, None, None, True))


ref_grouped_mm, ref_weight_grad = ref.grouped_mm, ref.grouped_mm_weight_grad


# -- the whole expert computation and the model ----------------------------------------------------------------
def _compare(got, want, tol):
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, **tol)
    for name in want[3]:
        torch.testing.assert_close(got[3][name], want[3][name], **tol, msg=name)


def _layer(experts, x, index, weights, backend):
    from hf_moe.ops import experts_forward

    with use_backend(backend):
        return _grads(lambda x, w: experts_forward(experts, x, index, w), experts, x, weights)


LAYER_CASES = [  # (n, k, e, routing, glu, bias)
    *[(n, k, e, mode, True, False) for n, k, e, mode in (CASES if KERNELS_RUN_HERE else [])],
    (30, 2, 5, "dropped", False, True),
    (30, 2, 5, "dropped", True, True),
    (16, 2, 6, "one_expert", False, True),
]


@kernels
@pytest.mark.parametrize("n,k,e,mode,glu,bias", LAYER_CASES)
def test_layer_forward_and_backward_fp32(n, k, e, mode, glu, bias):
    """Output, grad of the input, of the routing weights and of every expert parameter, against the torch backend."""
    experts = _Experts(e, 24, 20, glu=glu, bias=bias, dtype=torch.float32).to(DEVICE)
    x = torch.randn(n, 24, device=DEVICE)
    index, weights = _index(n, k, e, mode)
    got = _layer(experts, x, index, weights.float(), "triton")
    _compare(got, _layer(experts, x, index, weights.float(), "torch"), dict(rtol=1e-5, atol=1e-5))


@kernels
@pytest.mark.parametrize("glu,bias", [(True, False), (False, True)])
def test_layer_bf16(glu, bias):
    experts = _Experts(5, 24, 20, glu=glu, bias=bias, dtype=torch.bfloat16).to(DEVICE)
    x = torch.randn(30, 24, dtype=torch.bfloat16, device=DEVICE)
    index, weights = _index(30, 2, 5, "dropped")
    got = _layer(experts, x, index, weights.bfloat16(), "triton")
    _compare(got, _layer(experts, x, index, weights.bfloat16(), "torch"), dict(rtol=5e-2, atol=5e-2))
    assert got[0].dtype == torch.bfloat16


@kernels
def test_layer_fp64_matches_the_token_loop():
    """In fp64 the Triton path equals the definition (one token, one slot at a time) to 1e-10."""
    experts = _Experts(4, 12, 10, glu=True, bias=True).to(DEVICE)
    x = torch.randn(18, 12, dtype=torch.float64, device=DEVICE)
    index, weights = _index(18, 2, 4, "dropped")
    got = _layer(experts, x, index, weights, "triton")
    want = _grads(lambda x, w: _naive(experts, x, index, w), experts, x, weights)
    _compare(got, want, dict(rtol=1e-10, atol=1e-10))


@kernels
def test_composed_ops_and_activation_without_kernel():
    """`ExpertsFunction` composing the Triton ops one by one (no fused path), and an activation with no Triton
    kernel (quick_gelu runs in torch, the rest in Triton)."""
    from hf_moe.ops import dispatch_ops
    from hf_moe.ops.experts import run_experts

    index, weights = _index(20, 2, 4, "dropped")
    x = torch.randn(20, 12, device=DEVICE)
    experts = _Experts(4, 12, 10, glu=True, bias=True, dtype=torch.float32).to(DEVICE)
    ops = dataclasses.replace(dispatch_ops(x.device, "silu"), fused_forward=None, fused_backward=None)
    assert ops.name == "triton"
    params = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)
    got = _grads(lambda x, w: run_experts(ops, x, index, w, *params, "silu", True), experts, x, weights.float())
    _compare(got, _layer(experts, x, index, weights.float(), "torch"), dict(rtol=1e-5, atol=1e-5))

    quick = _Experts(4, 12, 10, glu=True, activation="quick_gelu", dtype=torch.float32).to(DEVICE)
    with use_backend("triton"):
        assert dispatch_ops(x.device, "quick_gelu").name == "triton, activation in torch"
    _compare(_layer(quick, x, index, weights.float(), "triton"), _layer(quick, x, index, weights.float(), "torch"),
             dict(rtol=1e-5, atol=1e-5))


@kernels
def test_no_tokens_at_all():
    experts = _Experts(4, 12, 10, glu=True, bias=True, dtype=torch.float32).to(DEVICE)
    x = torch.zeros(0, 12, device=DEVICE, requires_grad=True)
    weights = torch.zeros(0, 2, device=DEVICE, requires_grad=True)
    from hf_moe.ops import experts_forward

    with use_backend("triton"):
        out = experts_forward(experts, x, torch.zeros(0, 2, dtype=torch.long, device=DEVICE), weights)
        assert out.shape == (0, 12)
        out.sum().backward()
    assert experts.down_proj.grad.abs().sum() == 0 and x.grad.shape == (0, 12)


@kernels
@pytest.mark.slow
def test_training_step_of_a_converted_model_equals_the_torch_backend():
    """HF_MOE_BACKEND=triton (the child's setting) against the torch backend: loss (LM + balancing) and the gradient
    of every parameter after one training step of a converted tiny Llama."""
    from conftest import random_ids, tiny_dense

    from hf_moe import convert_to_moe
    from hf_moe.ops import dispatch_ops

    if INTERPRETING:
        assert os.environ.get("HF_MOE_BACKEND") == "triton"
        assert dispatch_ops(torch.device("cpu"), "silu").name == "triton"  # selected by the environment, not forced
    dense = tiny_dense("llama", num_hidden_layers=2, hidden_size=32, intermediate_size=40, num_attention_heads=4)
    model = convert_to_moe(dense, num_experts=4, top_k=2, noise=0.05).to(DEVICE)
    model.train()
    ids = random_ids(2, 8).to(DEVICE)

    def step(backend):
        model.zero_grad(set_to_none=True)
        with use_backend(backend):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        return out.loss.detach(), out.aux_loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, aux, grads = step("triton")
    want_loss, want_aux, want_grads = step("torch")
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(aux, want_aux, rtol=1e-6, atol=1e-6)
    assert grads.keys() == want_grads.keys() and any("experts" in name for name in grads)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@kernels
@pytest.mark.slow
def test_torch_compile_fullgraph_traces_the_triton_ops():
    from hf_moe import MoEConfig, SparseMoeBlock
    from transformers import LlamaConfig

    base = LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2)
    block = SparseMoeBlock(MoEConfig.from_base(base, num_experts=4, num_experts_per_tok=2)).to(DEVICE)
    x = torch.randn(2, 5, 16, device=DEVICE, requires_grad=True)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    with use_backend("triton"):
        want, got = block(x), compiled(x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])


@kernels
def test_env_report_under_the_interpreter():
    if not INTERPRETING:
        pytest.skip("the interpreter's report")
    from hf_moe.ops import backend_report

    report = backend_report()
    assert report["grouped_mm"][0] == "triton (interpreter)" and "TRITON_INTERPRET=1" in report["grouped_mm"][1]


@kernels
@pytest.mark.slow
def test_benchmark_gpu_table_runs_tiny_under_the_interpreter():
    """`benchmarks/moe_layer.py --device cuda`'s code path, end to end on tiny shapes, so it does not rot."""
    if not INTERPRETING:
        pytest.skip("the GPU run is the real benchmark")
    result = subprocess.run(
        [sys.executable, "benchmarks/moe_layer.py", "--device", "cpu", "--interpret", "--tiny", "--repeats", "1"],
        cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for name in ("Mixtral-like tiny", "Qwen3-30B-A3B-like tiny"):
        assert sum(line.startswith(name) for line in result.stdout.splitlines()) == 4, result.stdout
    assert result.stdout.count("outside its expert GEMMs") == 2, result.stdout
