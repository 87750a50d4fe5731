"""Autotune configs of the grouped GEMMs (grouped_gemm.py), per dtype, fitted to the device's shared memory.

Two families, because `tl.dot` takes two paths on sm90:
  * tensor cores (bf16, fp16, and fp32 when torch allows TF32: `torch.set_float32_matmul_precision("high")`):
    wgmma on warpgroups of 4 warps, operand tiles staged through shared memory by the software pipeline;
      - 128 x 256 x 64, 8 warps, 3 stages: the highest FLOPs per byte loaded, for large groups (Mixtral-like:
        ~4,000 rows per expert, N = 28,672 or 4,096); a 128 x 256 fp32 accumulator is 128 registers per thread;
      - 128 x 128 x 64, 8 warps, 4 stages: twice the tiles for the same work, which keeps 132 SMs busy when
        N / 256 tiles would leave a partial last wave;
      - 64 x 128 x 64, 4 warps, 4 stages: one warpgroup, for short groups (Qwen3-30B-A3B-like: E 128, k 8, ~1,000
        rows per expert), where a 128-row tile would be mostly padding at the group edges;
      - 64 x 64 x 128, 4 warps, 3 stages: small N (the [M, 1] bias products) and decode-sized groups.
  * FMA (fp32 at torch's default "highest" precision, fp64): no tensor cores; the product is summed in registers,
    so the tiles are smaller: ptxas spills the 128 x 256 tile there (with triton 3.6 and 3.9; the stack sizes are
    in docs/backends.md), and `python -m hf_moe.ops.triton.aot --dtype fp32` shows which tiles compile without a spill.
A third family (`UNALIGNED`) serves row strides that are not multiples of 16 elements (no cp.async pipelining).
GROUP_M = 8 orders the tiles so 8 row tiles sweep a weight column block while it is in L2. The weight gradient's
configs are the same tile shapes over (P, Q) with the group's rows as the reduction.

Shared memory: the pipeline keeps `num_stages` copies of the A and B tiles, (BLOCK_M + BLOCK_N) x BLOCK_K x itemsize
bytes each (exactly what Triton allots for the tensor-core path; an upper bound for FMA). sm90 allows 227 KB per
block, so in TF32 (4-byte operands) 128 x 128 x 64 with 4 stages (256 KB) and 128 x 256 x 64 with 3 (288 KB) do not
fit. `fit` lowers such a config's stages until it fits (at least 2) and drops it otherwise; the autotuner prunes
against the shared memory of the device it runs on (`device_shared_memory`).
The tiles are chosen by this reasoning and the compiler's checks, not by timing each alone; the kernels' speeds on
a GPU are in docs/backends.md.
"""

from __future__ import annotations

import torch
import triton

from .runtime import dot_precision

# Per-block shared memory (opt-in maximum) by compute capability major, for targets without a device to ask (AOT
# compiles, the interpreter): sm80 163 KB, sm90 227 KB, sm100 227 KB.
SHARED_BY_MAJOR = {8: 163 * 1024, 9: 227 * 1024, 10: 227 * 1024}
SM90_SHARED = SHARED_BY_MAJOR[9]
MIN_STAGES = 2


def _config(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m), num_warps=warps,
                         num_stages=stages)


def _wg_config(bp, bq, bk, warps, stages):
    return triton.Config(dict(BLOCK_P=bp, BLOCK_Q=bq, BLOCK_K=bk), num_warps=warps, num_stages=stages)


TENSOR_CORE = [_config(128, 256, 64, 8, 3), _config(128, 128, 64, 8, 4), _config(64, 128, 64, 4, 4),
               _config(64, 64, 128, 4, 3)]
TENSOR_CORE_WEIGHT_GRAD = [_wg_config(128, 256, 64, 8, 3), _wg_config(128, 128, 64, 8, 4),
                           _wg_config(64, 128, 64, 4, 4), _wg_config(64, 64, 128, 4, 3)]
# fp32 "highest" and fp64: the tiles that ptxas compiles for sm90 without a spill (aot.py --dtype fp32) with triton 3.6
# (the device's) and 3.9. 64 x 64 x 128 runs 8 warps: with 4, triton 3.6 spills it (3.9 does not).
FMA = [_config(64, 64, 64, 4, 3), _config(64, 64, 128, 8, 3), _config(64, 64, 32, 4, 4), _config(32, 64, 32, 4, 3)]
FMA_WEIGHT_GRAD = [_wg_config(128, 128, 32, 8, 3), _wg_config(64, 128, 32, 4, 3), _wg_config(64, 64, 64, 4, 3),
                   _wg_config(32, 64, 32, 4, 3)]
# A row stride that is not a multiple of 16 elements: Triton cannot prove the rows 16-byte aligned, loads them
# without cp.async (no pipelining), and the tensor-core tiles above spill; these do not (aot.py --odd-stride).
UNALIGNED = [_config(128, 128, 32, 8, 3), _config(64, 128, 32, 4, 3), _config(128, 64, 32, 4, 3),
             _config(64, 64, 32, 4, 4)]
UNALIGNED_WEIGHT_GRAD = [_wg_config(128, 128, 64, 8, 4), _wg_config(64, 128, 64, 4, 4), _wg_config(128, 128, 32, 8, 3),
                         _wg_config(64, 128, 32, 4, 3)]
EVERY = {"grouped_mm": TENSOR_CORE + FMA + UNALIGNED,
         "weight_grad": TENSOR_CORE_WEIGHT_GRAD + FMA_WEIGHT_GRAD + UNALIGNED_WEIGHT_GRAD}
KINDS = ("grouped_mm", "weight_grad")


def tile(config: triton.Config) -> tuple[int, int, int]:
    """(rows, columns, reduction) of a config's output tile: (BLOCK_M, BLOCK_N, BLOCK_K) or (BLOCK_P, BLOCK_Q,
    BLOCK_K)."""
    kw = config.kwargs
    if "BLOCK_M" in kw:
        return kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"]
    return kw["BLOCK_P"], kw["BLOCK_Q"], kw["BLOCK_K"]


def shared_bytes(config: triton.Config, itemsize: int, num_stages: int | None = None) -> int:
    """Shared memory of the pipeline's operand buffers: stages x (rows + columns) x BLOCK_K x itemsize."""
    rows, cols, red = tile(config)
    return (config.num_stages if num_stages is None else num_stages) * (rows + cols) * red * itemsize


def fit(configs: list[triton.Config], itemsize: int, shared_limit: int) -> list[triton.Config]:
    """Each config with its stages lowered until its operand buffers fit in `shared_limit` bytes (at least
    MIN_STAGES), dropping those that never fit; always at least the smallest config."""
    fitted = []
    for config in configs:
        stages = config.num_stages
        while stages > MIN_STAGES and shared_bytes(config, itemsize, stages) > shared_limit:
            stages -= 1
        if shared_bytes(config, itemsize, stages) <= shared_limit:
            fitted.append(triton.Config(dict(config.kwargs), num_warps=config.num_warps, num_stages=stages))
    return fitted or [min(configs, key=lambda c: shared_bytes(c, itemsize))]


def uses_tensor_cores(dtype: torch.dtype, precision: str | None) -> bool:
    """Whether `tl.dot` runs on tensor cores for these operands (16-bit types, and fp32 in TF32)."""
    return dtype in (torch.bfloat16, torch.float16) or (dtype == torch.float32 and precision == "tf32")


def configs_for(kind: str, dtype: torch.dtype, precision: str | None = None, shared_limit: int = SM90_SHARED,
                aligned: bool = True) -> list[triton.Config]:
    """The configs the autotuner tries for a GEMM `kind` ("grouped_mm" or "weight_grad") on `dtype` operands with
    `tl.dot` precision `precision` (None: `runtime.dot_precision(dtype)`, which follows torch's fp32 setting),
    fitted to `shared_limit` bytes of shared memory per block. `aligned`: every operand's row stride is a multiple
    of 16 elements (see `UNALIGNED`)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    precision = dot_precision(dtype) if precision is None else precision
    weight_grad = kind == "weight_grad"
    if not uses_tensor_cores(dtype, precision):
        base = FMA_WEIGHT_GRAD if weight_grad else FMA
    elif not aligned:
        base = UNALIGNED_WEIGHT_GRAD if weight_grad else UNALIGNED
    else:
        base = TENSOR_CORE_WEIGHT_GRAD if weight_grad else TENSOR_CORE
    return fit(base, dtype.itemsize, shared_limit)


# The row strides (elements between rows) of each GEMM's operands, by kernel argument name.
ROW_STRIDES = {"grouped_mm": ("stride_am", "stride_bk", "stride_bn"), "weight_grad": ("stride_am", "stride_bm")}


def aligned_strides(kind: str, args: dict) -> bool:
    """Whether the operands' row strides are multiples of 16 elements, which Triton needs to see to pipeline."""
    return all(args[name] % 16 == 0 or args[name] == 1 for name in ROW_STRIDES[kind])


def device_shared_memory(device: torch.device) -> int:
    """Shared memory per block (opt-in maximum) of `device`; for a CPU device (the interpreter) sm90's, the target
    whose configs the tests run."""
    if device.type != "cuda":
        return SM90_SHARED
    props = torch.cuda.get_device_properties(device)
    known = getattr(props, "shared_memory_per_block_optin", None)
    return int(known) if known else SHARED_BY_MAJOR.get(props.major, props.shared_memory_per_block)


def pruner(kind: str):
    """`early_config_prune` for triton.autotune: the configs of `configs_for` for the launch's operands and device."""

    def prune(configs, named_args, **kwargs):
        a = named_args["a_ptr"]
        limit = device_shared_memory(a.device)
        return configs_for(kind, a.dtype, kwargs.get("PRECISION"), limit, aligned_strides(kind, named_args))

    return prune
