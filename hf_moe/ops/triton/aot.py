"""Compile every Triton kernel for an NVIDIA GPU without one: `python -m hf_moe.ops.triton.aot [--arch 90]`.

Triton lowers a kernel to PTX and runs its bundled `ptxas` to a cubin with no GPU present. This checks that the
GPU code path compiles with the production block sizes (the interpreter runs the same Python, but not Triton's
compiler), and reads what ptxas allotted: registers per thread, spill stores (local memory) and shared memory.
Each kernel is compiled as a launch would specialise it: pointers and multiples of 16 marked 16-aligned, ones
folded into constants, at the shapes of a Qwen3-30B-A3B-like layer (H 2048, I 768, E 128, k 8, 16,384 tokens)
in bf16, the GEMMs once per autotune config.

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

from ...compat import TritonASTSource, TritonGPUTarget, triton_cuobjdump, triton_kernel_params
from . import activation, grouped_gemm, permute, routing

TOKENS, TOP_K, EXPERTS, HIDDEN, INTER = 16384, 8, 128, 2048, 768
ROWS = TOKENS * TOP_K


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


def cases():
    """(label, kernel, args, num_warps, num_stages) for every kernel, at the shapes in the module docstring."""
    bf16, i64, i32 = "*bf16", "*i64", "*i32"
    blocks = routing.GPU_BLOCKS
    num_blocks = triton.cdiv(ROWS, blocks["BLOCK"])
    yield "route rank", routing._route_rank_kernel, dict(
        index_ptr=i64, rank_ptr=i32, block_counts_ptr=i32, M=ROWS, E=EXPERTS, BLOCK=blocks["BLOCK"]), 4, 1
    yield "route scan", routing._route_scan_kernel, dict(
        block_counts_ptr=i32, bucket_start_ptr=i32, counts_ptr=i64, num_blocks=num_blocks, E=EXPERTS,
        SCAN_ROWS=blocks["SCAN_ROWS"], SCAN_COLS=blocks["SCAN_COLS"]), 4, 1
    yield "route scatter", routing._route_scatter_kernel, dict(
        index_ptr=i64, rank_ptr=i32, block_prefix_ptr=i32, bucket_start_ptr=i32, sorted_slots_ptr=i64,
        slot_to_row_ptr=i64, M=ROWS, E=EXPERTS, BLOCK=blocks["BLOCK"]), 4, 1
    pb = {k: v for k, v in permute.GPU_BLOCKS.items() if k != "num_warps"}
    yield "permute", permute._permute_kernel, dict(
        x_ptr=bf16, sorted_slots_ptr=i64, out_ptr=bf16, M=ROWS, H=HIDDEN, top_k=TOP_K, stride_xn=HIDDEN,
        stride_xh=1, **pb), permute.GPU_BLOCKS["num_warps"], 1
    yield "unpermute", permute._unpermute_kernel, dict(
        rows_ptr=bf16, slot_to_row_ptr=i64, weights_ptr=bf16, out_ptr=bf16, N=TOKENS, H=HIDDEN, top_k=TOP_K,
        stride_rm=HIDDEN, stride_rh=1, stride_wn=TOP_K, stride_wk=1, HAS_WEIGHTS=True, ACC=tl.float32,
        **pb), permute.GPU_BLOCKS["num_warps"], 1
    ab = {k: v for k, v in activation.GPU_BLOCKS.items() if k != "num_warps"}
    for act in activation.ACTIVATIONS:
        yield f"act fwd {act}", activation._act_fwd_kernel, dict(
            h_ptr=bf16, scale_ptr=bf16, out_ptr=bf16, M=ROWS, W=INTER, stride_hm=2 * INTER, stride_hw=1, ACT=act,
            GLU=True, HAS_SCALE=True, COMPUTE=tl.float32, **ab), activation.GPU_BLOCKS["num_warps"], 1
        yield f"act bwd {act}", activation._act_bwd_kernel, dict(
            grad_ptr=bf16, h_ptr=bf16, scale_ptr=bf16, grad_h_ptr=bf16, grad_scale_ptr=bf16, out_ptr=bf16, M=ROWS,
            W=INTER, stride_gm=INTER, stride_gw=1, stride_hm=2 * INTER, stride_hw=1, ACT=act, GLU=True,
            HAS_SCALE=True, RETURN_OUTPUT=True, COMPUTE=tl.float32, **ab), activation.GPU_BLOCKS["num_warps"], 1
    # The first expert GEMM (tokens gathered in the loads): [M, H] x [E, H, 2I] -> [M, 2I].
    for config in grouped_gemm.SM90_CONFIGS:
        k, n = HIDDEN, 2 * INTER
        yield _gemm_label("grouped_mm", config), grouped_gemm._grouped_mm_kernel, dict(
            a_ptr=bf16, b_ptr=bf16, c_ptr=bf16, counts_ptr=i64, gather_ptr=i64, bias_ptr=bf16, scale_ptr=bf16,
            M=ROWS, N=n, K=k, E=EXPERTS, top_k=TOP_K, rows_hint=ROWS // EXPERTS, stride_am=k, stride_ak=1,
            stride_be=n * k, stride_bk=1, stride_bn=k, stride_cm=n, stride_cn=1, stride_bias_e=n, stride_bias_n=1,
            HAS_GATHER=True, HAS_BIAS=False, HAS_SCALE=False, EVEN_K=k % config.kwargs["BLOCK_K"] == 0,
            UPCAST=False, ACC=tl.float32, PRECISION=None, E_POW2=triton.next_power_of_2(EXPERTS + 1),
            **config.kwargs), config.num_warps, config.num_stages
    # The down projection's weight gradient: grad_out[g]^T (gathered) @ a[g] -> [E, H, I].
    for config in grouped_gemm.SM90_WEIGHT_GRAD_CONFIGS:
        p, q = HIDDEN, INTER
        yield _gemm_label("weight_grad", config), grouped_gemm._grouped_mm_weight_grad_kernel, dict(
            a_ptr=bf16, b_ptr=bf16, c_ptr=bf16, counts_ptr=i64, gather_ptr=i64, M=ROWS, P=p, Q=q, E=EXPERTS,
            top_k=TOP_K, rows_hint=ROWS // EXPERTS, stride_am=p, stride_ap=1, stride_bm=q, stride_bq=1,
            stride_ce=p * q, stride_cp=q, stride_cq=1, GATHER_A=True, GATHER_B=False, UPCAST=False, ACC=tl.float32,
            PRECISION=None, E_POW2=triton.next_power_of_2(EXPERTS), **config.kwargs), config.num_warps, \
            config.num_stages


def _gemm_label(name: str, config) -> str:
    blocks = "x".join(str(v) for k, v in config.kwargs.items() if k.startswith("BLOCK"))
    return f"{name} {blocks} w{config.num_warps} s{config.num_stages}"


def _resources(cubin: bytes) -> dict[str, int]:
    """REG, LOCAL (spill bytes per thread) and SHARED (static) from `cuobjdump -res-usage`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([triton_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return {key: int(value) for key, value in re.findall(r"(REG|LOCAL|SHARED):(\d+)", text)}


def compile_all(arch: int = 90, only: str = ""):
    """Compile every case for sm{arch}; yields (label, seconds, registers, spill bytes, shared bytes, wgmma)."""
    target = TritonGPUTarget("cuda", arch, 32)
    for label, kernel, args, warps, stages in cases():
        if only and only not in label:
            continue
        signature, constexprs, attrs = _signature(kernel, args)
        start = time.perf_counter()
        compiled = triton.compile(TritonASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True))
        seconds = time.perf_counter() - start
        res = _resources(compiled.asm["cubin"])
        yield label, seconds, res.get("REG", 0), res.get("LOCAL", 0), compiled.metadata.shared, \
            "wgmma" in compiled.asm["ptx"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100)")
    parser.add_argument("--only", default="", help="compile only the cases whose label contains this")
    args = parser.parse_args(argv)
    if triton.knobs.runtime.interpret:
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels Triton would compile", file=sys.stderr)
        return 2
    print(f"triton {triton.__version__}, target sm{args.arch}; shapes: {TOKENS} tokens, k {TOP_K}, E {EXPERTS}, "
          f"H {HIDDEN}, I {INTER}, bf16")
    header = f"{'kernel':<34} {'compile s':>9} {'regs':>5} {'spill B':>7} {'shared KB':>9} {'wgmma':>5}"
    print(f"{header}\n{'-' * len(header)}")
    for label, seconds, regs, spill, shared, wgmma in compile_all(args.arch, args.only):
        print(f"{label:<34} {seconds:>9.1f} {regs:>5} {spill:>7} {shared / 1024:>9.1f} {'yes' if wgmma else '-':>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
