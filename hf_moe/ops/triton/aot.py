"""Compile every Triton kernel for an NVIDIA GPU without one: `python -m hf_moe.ops.triton.aot [--arch 90]
[--dtype bf16|fp16|fp32|tf32|all] [--odd-stride] [--only LABEL]`.

Triton lowers a kernel to PTX and runs its bundled `ptxas` to a cubin with no GPU present. This checks that the
GPU code path compiles with the production block sizes (the interpreter runs the same Python, but not Triton's
compiler), and reads what ptxas allotted per thread: registers, the stack frame (`STACK`: where ptxas puts the
registers it spills; `LOCAL` is always 0 in this toolchain) and the spill instructions in the SASS (local-memory
stores and loads, STL / LDL), and per block the shared memory. Each kernel is compiled as a launch would specialise
it: pointers and multiples of 16 marked 16-aligned, ones folded into constants, at the shapes of a
Qwen3-30B-A3B-like layer (H 2048, I 768, E 128, k 8, 16,384 tokens), the GEMMs once per autotune config that
configs.py gives that dtype on sm90.

    --dtype       bf16 (default), fp16, fp32 (torch's default "highest" precision: FMA, no tensor cores), tf32
                  (fp32 after `torch.set_float32_matmul_precision("high")`), or all of them
    --odd-stride  also the GEMMs with row strides that are not a multiple of 16 elements (H 2056), which Triton
                  cannot prove 16-byte aligned: no cp.async pipelining, and the UNALIGNED configs

Must run without TRITON_INTERPRET (the kernels must be `JITFunction`s, not interpreted ones).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time

import triton
import triton.language as tl

import torch

from ...compat import TritonASTSource, TritonGPUTarget, triton_cuobjdump, triton_kernel_params
from . import activation, grouped_gemm, permute, routing
from .configs import SHARED_BY_MAJOR, configs_for

TOKENS, TOP_K, EXPERTS, HIDDEN, INTER = 16384, 8, 128, 2048, 768
ROWS = TOKENS * TOP_K
ODD_HIDDEN = 2056  # a multiple of 8 (16 bytes in bf16) but not of 16 elements: Triton sees no 16-alignment
# --dtype name -> (pointer type, torch dtype, tl.dot precision)
DTYPES = {
    "bf16": ("*bf16", torch.bfloat16, None),
    "fp16": ("*fp16", torch.float16, None),
    "fp32": ("*fp32", torch.float32, "ieee"),
    "tf32": ("*fp32", torch.float32, "tf32"),
}


def _signature(kernel, args: dict):
    """(signature, constexprs, attrs) for `triton.compile`, specialised like a launch with these arguments.

    Args: param name -> "*bf16"-style pointer type, int, or (for constexpr params) the value.
    """
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, is_constexpr) in enumerate(triton_kernel_params(kernel)):
        value = args[name]
        if is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, str):
            signature[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif value == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def cases(dtype: str = "bf16", odd_stride: bool = False, gemms_only: bool = False, arch: int = 90):
    """(label, kernel, args, num_warps, num_stages) for every kernel in `dtype` (a `DTYPES` name), at the shapes in
    the module docstring; with `odd_stride`, the GEMMs at hidden size ODD_HIDDEN instead; `gemms_only`: only the
    GEMMs (the other kernels' code does not depend on the dot's dtype)."""
    ptr, torch_dtype, precision = DTYPES[dtype]
    i64, i32 = "*i64", "*i32"
    tag = f" {dtype}" + (" odd" if odd_stride else "")
    if not (gemms_only or odd_stride):
        yield from _other_cases(ptr, i64, i32, tag)
    hidden = ODD_HIDDEN if odd_stride else HIDDEN
    shared = SHARED_BY_MAJOR.get(arch // 10, SHARED_BY_MAJOR[9])
    # The first expert GEMM (tokens gathered in the loads): [M, H] x [E, H, 2I] -> [M, 2I].
    for config in configs_for("grouped_mm", torch_dtype, precision, shared, aligned=not odd_stride):
        k, n = hidden, 2 * INTER
        yield _gemm_label("grouped_mm", config) + tag, grouped_gemm._grouped_mm_kernel, dict(
            a_ptr=ptr, b_ptr=ptr, c_ptr=ptr, counts_ptr=i64, gather_ptr=i64, bias_ptr=ptr, scale_ptr=ptr,
            M=ROWS, N=n, K=k, E=EXPERTS, top_k=TOP_K, rows_hint=ROWS // EXPERTS, stride_am=k, stride_ak=1,
            stride_be=n * k, stride_bk=1, stride_bn=k, stride_cm=n, stride_cn=1, stride_bias_e=n, stride_bias_n=1,
            HAS_GATHER=True, HAS_BIAS=False, HAS_SCALE=False, EVEN_K=k % config.kwargs["BLOCK_K"] == 0,
            UPCAST=False, ACC=tl.float32, PRECISION=precision, E_POW2=triton.next_power_of_2(EXPERTS + 1),
            **config.kwargs), config.num_warps, config.num_stages
    # The down projection's weight gradient: grad_out[g]^T (gathered) @ a[g] -> [E, H, I].
    for config in configs_for("weight_grad", torch_dtype, precision, shared, aligned=not odd_stride):
        p, q = hidden, INTER
        yield _gemm_label("weight_grad", config) + tag, grouped_gemm._grouped_mm_weight_grad_kernel, dict(
            a_ptr=ptr, b_ptr=ptr, c_ptr=ptr, counts_ptr=i64, gather_ptr=i64, M=ROWS, P=p, Q=q, E=EXPERTS,
            top_k=TOP_K, rows_hint=ROWS // EXPERTS, stride_am=p, stride_ap=1, stride_bm=q, stride_bq=1,
            stride_ce=p * q, stride_cp=q, stride_cq=1, GATHER_A=True, GATHER_B=False, UPCAST=False, ACC=tl.float32,
            PRECISION=precision, E_POW2=triton.next_power_of_2(EXPERTS), **config.kwargs), config.num_warps, \
            config.num_stages


def _other_cases(ptr, i64, i32, tag):
    blocks = routing.GPU_BLOCKS
    num_blocks = triton.cdiv(ROWS, blocks["BLOCK"])
    if tag.strip() == "bf16":  # integer kernels: once
        yield "route rank", routing._route_rank_kernel, dict(
            index_ptr=i64, rank_ptr=i32, block_counts_ptr=i32, M=ROWS, E=EXPERTS, BLOCK=blocks["BLOCK"]), 4, 1
        yield "route scan", routing._route_scan_kernel, dict(
            block_counts_ptr=i32, bucket_start_ptr=i32, counts_ptr=i64, num_blocks=num_blocks, E=EXPERTS,
            SCAN_ROWS=blocks["SCAN_ROWS"], SCAN_COLS=blocks["SCAN_COLS"]), 4, 1
        yield "route scatter", routing._route_scatter_kernel, dict(
            index_ptr=i64, rank_ptr=i32, block_prefix_ptr=i32, bucket_start_ptr=i32, sorted_slots_ptr=i64,
            slot_to_row_ptr=i64, M=ROWS, E=EXPERTS, BLOCK=blocks["BLOCK"]), 4, 1
    pb = {k: v for k, v in permute.GPU_BLOCKS.items() if k != "num_warps"}
    yield "permute" + tag, permute._permute_kernel, dict(
        x_ptr=ptr, sorted_slots_ptr=i64, out_ptr=ptr, M=ROWS, H=HIDDEN, top_k=TOP_K, stride_xn=HIDDEN,
        stride_xh=1, **pb), permute.GPU_BLOCKS["num_warps"], 1
    yield "unpermute" + tag, permute._unpermute_kernel, dict(
        rows_ptr=ptr, slot_to_row_ptr=i64, weights_ptr=ptr, out_ptr=ptr, N=TOKENS, H=HIDDEN, top_k=TOP_K,
        stride_rm=HIDDEN, stride_rh=1, stride_wn=TOP_K, stride_wk=1, HAS_WEIGHTS=True, ACC=tl.float32,
        **pb), permute.GPU_BLOCKS["num_warps"], 1
    ab = {k: v for k, v in activation.GPU_BLOCKS.items() if k != "num_warps"}
    for act in activation.ACTIVATIONS:
        yield f"act fwd {act}" + tag, activation._act_fwd_kernel, dict(
            h_ptr=ptr, scale_ptr=ptr, out_ptr=ptr, M=ROWS, W=INTER, stride_hm=2 * INTER, stride_hw=1, ACT=act,
            GLU=True, HAS_SCALE=True, COMPUTE=tl.float32, **ab), activation.GPU_BLOCKS["num_warps"], 1
        yield f"act bwd {act}" + tag, activation._act_bwd_kernel, dict(
            grad_ptr=ptr, h_ptr=ptr, scale_ptr=ptr, grad_h_ptr=ptr, grad_scale_ptr=ptr, out_ptr=ptr, M=ROWS,
            W=INTER, stride_gm=INTER, stride_gw=1, stride_hm=2 * INTER, stride_hw=1, ACT=act, GLU=True,
            HAS_SCALE=True, RETURN_OUTPUT=True, COMPUTE=tl.float32, **ab), activation.GPU_BLOCKS["num_warps"], 1


def _gemm_label(name: str, config) -> str:
    blocks = "x".join(str(v) for k, v in config.kwargs.items() if k.startswith("BLOCK"))
    return f"{name} {blocks} w{config.num_warps} s{config.num_stages}"


def _resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK (bytes per thread: spilled registers live there) and SHARED (static) from `cuobjdump -res-usage`,
    and SPILLS: the local-memory stores and loads (STL, LDL) in the SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = dict(capture_output=True, text=True, check=True)
        usage = subprocess.run([triton_cuobjdump(), "-res-usage", f.name], **run).stdout
        sass = subprocess.run([triton_cuobjdump(), "-sass", f.name], **run).stdout
    found = {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", usage)}
    found["SPILLS"] = len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\s", sass))
    return found


def compile_all(arch: int = 90, only: str = "", dtypes: tuple[str, ...] = ("bf16",), odd_stride: bool = False,
                gemms_only: bool = False):
    """Compile every case for sm{arch}; yields dicts: label, seconds, regs, stack (bytes per thread), spills (STL/LDL
    instructions), shared (bytes per block), wgmma and cp_async (whether the PTX uses them)."""
    target = TritonGPUTarget("cuda", arch, 32)
    todo = [c for d in dtypes for c in cases(d, gemms_only=gemms_only and d != "bf16", arch=arch)]
    if odd_stride:
        todo += list(cases("bf16", odd_stride=True, arch=arch))
    for label, kernel, args, warps, stages in todo:
        if only and only not in label:
            continue
        signature, constexprs, attrs = _signature(kernel, args)
        start = time.perf_counter()
        compiled = triton.compile(TritonASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True))
        seconds = time.perf_counter() - start
        res = _resources(compiled.asm["cubin"])
        ptx = compiled.asm["ptx"]
        yield dict(label=label, seconds=seconds, regs=res.get("REG", 0), stack=res.get("STACK", 0),
                   spills=res["SPILLS"], shared=compiled.metadata.shared, wgmma="wgmma" in ptx,
                   cp_async="cp.async" in ptx)


COLUMNS = f"{'kernel':<40} {'compile s':>9} {'regs':>5} {'stack B':>7} {'spills':>6} {'shared KB':>9} {'wgmma':>5} " \
          f"{'cp.async':>8}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100)")
    parser.add_argument("--only", default="", help="compile only the cases whose label contains this")
    parser.add_argument("--dtype", default="bf16", choices=[*DTYPES, "all"])
    parser.add_argument("--odd-stride", action="store_true", help="also the GEMMs at a row stride not a multiple of 16")
    parser.add_argument("--gemms-only", action="store_true", help="other dtypes than bf16: only the GEMMs")
    args = parser.parse_args(argv)
    if triton.knobs.runtime.interpret:
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels Triton would compile", file=sys.stderr)
        return 2
    dtypes = tuple(DTYPES) if args.dtype == "all" else (args.dtype,)
    print(f"triton {triton.__version__}, target sm{args.arch}; shapes: {TOKENS} tokens, k {TOP_K}, E {EXPERTS}, "
          f"H {HIDDEN} (odd stride: {ODD_HIDDEN}), I {INTER}; dtypes: {', '.join(dtypes)}")
    print(f"{COLUMNS}\n{'-' * len(COLUMNS)}")
    for r in compile_all(args.arch, args.only, dtypes, args.odd_stride, args.gemms_only):
        print(f"{r['label']:<40} {r['seconds']:>9.1f} {r['regs']:>5} {r['stack']:>7} {r['spills']:>6} "
              f"{r['shared'] / 1024:>9.1f} {'yes' if r['wgmma'] else '-':>5} {'yes' if r['cp_async'] else '-':>8}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
