"""The Triton backend around its kernels: the kernel tests under the interpreter (a subprocess), Triton's
ahead-of-time compiler for sm90, the GEMM configs against shared memory, the per-device and per-dtype choice of
backend, and what `python -m hf_moe.env` reports. tests/triton_support.py says how the Triton files run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from triton_support import (
    KERNELS_RUN_HERE,
    LAUNCHES_FILE,
    ON_GPU,
    ROOT,
    _launch_table,  # noqa: F401 (autouse fixture)
    _no_fallback,  # noqa: F401 (autouse fixture)
    _table,
    all_kernel_names,
    parent_only,
    triton_test_files,
)

from hf_moe.ops import use_backend


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.gpu
@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run in this process")
def test_kernels_under_the_interpreter(tmp_path, capsys):
    from hf_moe.compat import triton_interpreter_problem

    if triton_interpreter_problem():  # triton 3.6 with numpy >= 2.4: the interpreter itself fails
        pytest.skip(triton_interpreter_problem())
    launches = tmp_path / "launches.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_MOE_BACKEND": "triton", LAUNCHES_FILE: str(launches)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *map(str, triton_test_files()), "-q", "-x", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, f"kernel tests failed:\n{result.stdout[-12000:]}\n{result.stderr[-3000:]}"
    counts = json.loads(launches.read_text())["launches"]
    missing = all_kernel_names() - {name for name, n in counts.items() if n > 0}
    assert not missing, f"kernels no test launched: {sorted(missing)}"
    summary = [line for line in result.stdout.splitlines() if " passed" in line]
    with capsys.disabled():
        print(f"\n{_table(counts, 'interpreter')}\n  (subprocess, TRITON_INTERPRET=1: "
              f"{summary[-1].strip('= ') if summary else ''})")



@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.compile
@pytest.mark.gpu_versions
@parent_only
def test_every_kernel_compiles_for_sm90():
    """The GPU code path through Triton's compiler (no GPU needed): every kernel, the GEMMs in every autotune config
    of bf16, fp16, fp32 (FMA), TF32 and a row stride that is not a multiple of 16, to PTX (wgmma on tensor cores,
    cp.async pipelining where the strides allow) and ptxas' cubin: no spill (no stack frame, no STL/LDL) and within
    sm90's shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "hf_moe.ops.triton.aot", "--dtype", "all", "--odd-stride", "--gemms-only"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = [line.rsplit(None, 7) for line in result.stdout.splitlines()[3:] if line.strip()]
    compiled = {row[0]: row[1:] for row in rows}
    from hf_moe.ops.triton import aot

    every = [*(c for d in aot.DTYPES for c in aot.cases(d, gemms_only=d != "bf16")), *aot.cases("bf16", True)]
    assert set(compiled) == {label for label, *_ in every}, result.stdout
    assert {case[1].fn.__name__ for case in every} == all_kernel_names()  # every kernel has a case
    for label, (_, regs, stack, spills, shared_kb, wgmma, cp_async) in compiled.items():
        assert int(stack) == 0 and int(spills) == 0, f"{label} spills registers:\n{result.stdout}"
        assert float(shared_kb) <= 227, f"{label} needs more shared memory than sm90 has:\n{result.stdout}"
        assert int(regs) <= 255
        if label.startswith(("grouped_mm", "weight_grad")):
            assert (wgmma == "yes") == ("fp32" not in label), f"{label}: wgmma={wgmma}\n{result.stdout}"
            if "odd" not in label:
                assert cp_async == "yes", f"{label} is not pipelined:\n{result.stdout}"


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.oldest
@parent_only
def test_aot_check_sees_spills():
    """The check reads the stack frame and counts STL/LDL: the old fp32 128 x 256 tile spills under triton 3.9 and
    3.6 (the device's triton; the sizes are in docs/backends.md); a kernel that does not spill has neither."""
    from hf_moe.compat import TritonASTSource, TritonGPUTarget
    from hf_moe.ops.triton import aot, configs

    import triton

    label, kernel, args, warps, stages = next(aot.cases("fp32", gemms_only=True))
    args = dict(args, **configs.TENSOR_CORE[0].kwargs, EVEN_K=True)  # 128 x 256 x 64, as before the fix
    compiled = triton.compile(TritonASTSource(kernel, *aot._signature(kernel, args)),
                              target=TritonGPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3))
    found = aot._resources(compiled.asm["cubin"])
    assert found["STACK"] >= 1024 and found["SPILLS"] > 100, found



@pytest.mark.gpu
@pytest.mark.oldest
@parent_only
def test_interpreter_problem_of_triton_3_6_with_numpy_2_4(monkeypatch):
    """triton 3.6's interpreter fails every kernel loop with a run-time bound under numpy >= 2.4 (triton#9171, fixed
    in 3.7): compat names the problem and the fix for that pair only."""
    import importlib.metadata

    from hf_moe.compat import triton_interpreter_problem

    for triton_version, numpy_version, broken in [("3.6.0", "2.4.1", True), ("3.6.0", "2.5.2", True),
                                                  ("3.6.0", "2.3.5", False), ("3.9.0", "2.4.6", False),
                                                  ("3.7.0", "2.5.0", False)]:
        versions = {"triton": triton_version, "numpy": numpy_version}
        monkeypatch.setattr(importlib.metadata, "version", versions.__getitem__)
        problem = triton_interpreter_problem()
        assert (problem is not None) == broken, (versions, problem)
        if broken:
            assert f"triton {triton_version}" in problem and "numpy<2.4" in problem


@pytest.mark.gpu
@pytest.mark.oldest
@parent_only
def test_configs_fit_the_device_shared_memory():
    """In TF32 (fp32 operands, 4 bytes) the 128 x 128 x 64 tile with 4 stages needs 256 KB and 128 x 256 x 64 with 3
    needs 288 KB; sm90 allows 227 KB per block. They run with fewer stages; bf16 keeps every config as it is; fp32 at
    "highest" precision and rows not 16-aligned get their own spill-free tiles; the autotuner's pruner asks the
    device (sm90's limit for the interpreter's CPU tensors)."""
    from hf_moe.ops.triton import configs

    sm90 = 227 * 1024
    assert configs.SHARED_BY_MAJOR[9] == sm90
    big, square = configs.TENSOR_CORE[0], configs.TENSOR_CORE[1]
    assert configs.shared_bytes(square, 4) == 256 * 1024 and configs.shared_bytes(big, 4) == 288 * 1024
    assert configs.shared_bytes(big, 2) == 144 * 1024
    tf32 = configs.configs_for("grouped_mm", torch.float32, "tf32", sm90)
    assert [(configs.tile(c), c.num_stages) for c in tf32] == [
        ((128, 256, 64), 2), ((128, 128, 64), 3), ((64, 128, 64), 4), ((64, 64, 128), 3)]
    for kind in configs.KINDS:
        for dtype, precision in [(torch.float32, "tf32"), (torch.bfloat16, None), (torch.float16, None),
                                 (torch.float32, "ieee"), (torch.float64, "ieee")]:
            for limit in (sm90, configs.SHARED_BY_MAJOR[8], 100 * 1024):
                fitted = configs.configs_for(kind, dtype, precision, limit)
                assert fitted and all(configs.shared_bytes(c, dtype.itemsize) <= limit for c in fitted)
    bf16 = configs.configs_for("grouped_mm", torch.bfloat16, None, sm90)
    assert [(c.kwargs, c.num_stages) for c in bf16] == [(c.kwargs, c.num_stages) for c in configs.TENSOR_CORE]
    assert configs.configs_for("grouped_mm", torch.float32, "ieee", sm90)[0].kwargs == configs.FMA[0].kwargs
    unaligned = configs.configs_for("weight_grad", torch.bfloat16, None, sm90, aligned=False)
    assert [c.kwargs for c in unaligned] == [c.kwargs for c in configs.UNALIGNED_WEIGHT_GRAD]
    x = torch.empty(4, 8, dtype=torch.float32)
    pruned = configs.pruner("grouped_mm")(configs.EVERY["grouped_mm"], dict(a_ptr=x, stride_am=2048, stride_bk=1,
                                                                           stride_bn=2048), PRECISION="tf32")
    assert [(c.kwargs, c.num_stages) for c in pruned] == [(c.kwargs, c.num_stages) for c in tf32]
    odd = configs.pruner("grouped_mm")(configs.EVERY["grouped_mm"], dict(a_ptr=x.bfloat16(), stride_am=2056,
                                                                        stride_bk=1, stride_bn=2056), PRECISION=None)
    assert [c.kwargs for c in odd] == [c.kwargs for c in configs.UNALIGNED]


@pytest.mark.gpu
@pytest.mark.oldest
@parent_only
def test_grouped_mm_selection_with_faked_capability():
    """torch's grouped_mm for bf16 on sm90 with 16-byte aligned dims; the Triton GEMM everywhere else, sm100 included
    (torch's grouped_mm gives experts without rows non-zero weight gradients there: pytorch/pytorch#172439)."""
    from hf_moe.ops.triton.grouped_gemm import torch_grouped_mm_usable as usable

    cuda, bf16, fp32 = torch.device("cuda", 0), torch.bfloat16, torch.float32
    assert usable(cuda, (bf16, bf16), (2048, 1536), capability=(9, 0))
    assert not usable(cuda, (bf16, bf16), (2048, 1536), capability=(10, 0))
    assert not usable(cuda, (bf16, bf16), (2048, 1536), capability=(10, 3))
    assert not usable(cuda, (bf16, bf16), (2048, 1536), capability=(8, 0))  # torch's fallback syncs: Triton
    assert not usable(cuda, (bf16, bf16), (2048, 1536), capability=(12, 0))
    assert not usable(cuda, (fp32, fp32), (2048, 1536), capability=(9, 0))
    assert not usable(cuda, (bf16, fp32), (2048, 1536), capability=(9, 0))
    assert not usable(cuda, (bf16, bf16), (2048, 1), capability=(9, 0))  # the [M, 1] bias products
    assert not usable(cuda, (bf16, bf16), (2048, 20), capability=(9, 0))
    assert not usable(torch.device("cpu"), (bf16, bf16), (2048, 1536), capability=(9, 0))


@pytest.mark.gpu
@pytest.mark.oldest
@parent_only
def test_triton_on_cpu_without_the_interpreter_says_what_to_do():
    from hf_moe.ops.triton import status

    usable, why = status("cpu")
    assert not usable and "TRITON_INTERPRET=1" in why
    experts = _experts_module()
    with use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        from hf_moe.ops import experts_forward

        experts_forward(experts, torch.randn(3, 8), torch.tensor([[0, 1]] * 3), torch.rand(3, 2))


@pytest.mark.subprocess
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
    auto = subprocess.run([sys.executable, "-m", "hf_moe.env"], cwd=ROOT, env={**env, "HF_MOE_BACKEND": "auto"},
                          capture_output=True, text=True, timeout=600)
    default = next(line for line in auto.stdout.splitlines() if line.startswith("default on CUDA"))
    assert "torch ops" in default and "hf_moe.gpu_check" in default, auto.stdout


@parent_only
def test_cuda_default_is_triton_for_bf16_on_sm90(monkeypatch):
    """On CUDA, auto (and compiled) run the Triton kernels for bf16 experts on sm90, where they passed gpu_check on an
    H100 and ran faster than the torch ops (docs/backends.md), and the pure-torch ops for other dtypes, other GPUs,
    or where Triton cannot run. The GPU is faked: none here."""
    import hf_moe.ops.backend as backend

    def choose(where):  # as dispatch does: the setting of HF_MOE_BACKEND at the call
        return backend._choose(os.environ["HF_MOE_BACKEND"], where)

    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(backend, "_triton_status", lambda device_type: (True, "faked sm90"))
    for setting in ("auto", "compiled"):
        monkeypatch.setenv("HF_MOE_BACKEND", setting)
        assert choose(("cuda", 0, torch.bfloat16)) == "triton"
        assert "bf16 on sm90" in backend.cuda_default(0, torch.bfloat16)[1]
        assert backend.backend_report()["experts on CUDA, bf16"][0].startswith("triton kernels")
        for dtype in (torch.float32, torch.float16, None):
            assert choose(("cuda", 0, dtype)) == "torch"
        assert backend.backend_report()["experts on CUDA, other"][0].startswith("torch ops")
        for capability[0] in [(8, 0), (10, 0), (12, 0)]:  # A100; B200 and newer (grouped_mm's weight gradients)
            assert choose(("cuda", 0, torch.bfloat16)) == "torch"
            assert f"bfloat16 on sm{capability[0][0]}0" in backend.cuda_default(0)[1]
        capability[0] = (9, 0)
    monkeypatch.setenv("HF_MOE_BACKEND", "torch")
    assert choose(("cuda", 0, torch.bfloat16)) == "torch"
    monkeypatch.setenv("HF_MOE_BACKEND", "triton")
    assert choose(("cuda", 0, torch.float32)) == "triton"
    monkeypatch.setenv("HF_MOE_BACKEND", "auto")
    monkeypatch.setattr(backend, "_triton_status", lambda device_type: (False, "triton is not installed"))
    assert choose(("cuda", 0, torch.bfloat16)) == "torch"
    assert "Triton cannot run here (triton is not installed)" in backend.cuda_default(0)[1]
    with pytest.raises(RuntimeError, match="cannot run on cuda tensors: triton is not installed"):
        backend._variant("triton", "cuda", "silu")
    with pytest.raises(RuntimeError, match="runs on CPU tensors, not cuda"):
        backend._variant("compiled", "cuda", "silu")


@pytest.mark.gpu
@pytest.mark.oldest
def test_dispatch_on_cuda_is_chosen_per_device_and_dtype(monkeypatch):
    """The experts' dtype reaches the choice: one device runs bf16 experts on one backend and fp32 on another."""
    import hf_moe.ops.backend as backend

    chosen = []
    monkeypatch.setattr(backend, "_chosen", {})
    monkeypatch.setattr(backend, "_variants", {})
    monkeypatch.setattr(backend, "_choose", lambda setting, where: chosen.append(where) or
                        ("triton" if where[2] == torch.bfloat16 else "torch"))
    monkeypatch.setattr(backend, "_variant", lambda name, device_type, activation: (name, device_type, activation))
    cuda = torch.device("cuda", 0)
    assert backend.dispatch_ops(cuda, "silu", torch.bfloat16) == ("triton", "cuda", "silu")
    assert backend.dispatch_ops(cuda, "silu", torch.float32) == ("torch", "cuda", "silu")
    assert backend.dispatch_ops(cuda, "gelu", torch.bfloat16) == ("triton", "cuda", "gelu")
    assert backend.dispatch_ops(torch.device("cpu"), "silu", torch.bfloat16)[1] == "cpu"
    assert chosen == [("cuda", 0, torch.bfloat16), ("cuda", 0, torch.float32), ("cpu", None, None)]


def _experts_module():
    from hf_moe import MoEConfig
    from hf_moe.layers.experts import Experts
    from transformers import LlamaConfig

    base = LlamaConfig(hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2)
    return Experts(MoEConfig.from_base(base, num_experts=3, num_experts_per_tok=2))


@pytest.mark.gpu
@pytest.mark.oldest
@parent_only
def test_activation_kernels_match_the_ops_list():
    from hf_moe.ops.triton import activation, ops

    assert set(activation.ACTIVATIONS) == set(ops.ACTIVATIONS)
