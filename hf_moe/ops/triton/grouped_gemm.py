"""Grouped GEMMs over contiguous row groups (one group per expert), forward, dX and dW, with no host sync.

    grouped_mm:              out[r] = a[r] @ B[e(r)] (+ bias[e(r)] * scale[r])    a [M, K], B [E, K, N] (any strides)
    grouped_mm_weight_grad:  out[e] = a[g_e]^T @ b[g_e]                             a [M, P], b [M, Q] -> [E, P, Q]

Rows past the last group (dropped pairs) are zero in `grouped_mm`'s output; experts without rows get zero
weight gradients. Either GEMM can read its row-major operand through `gather_index` (row r is
`x[gather_index[r] // top_k]`), which fuses `permute` into the GEMM's loads: the forward's first GEMM reads the
tokens directly, and the backward reads the output gradient and the tokens without [M, H] copies.

No host sync: the group sizes stay on the device. The forward grid is sized for the worst case, cdiv(M, BLOCK_M)
+ E row tiles (each group adds at most one partial tile; the dropped rows are group E); each program finds its
group from the counts with a cumsum over E + 1 lanes (< 1 µs) and exits when past the last tile. The weight
gradient's grid is (tiles of [P, Q], E); each program loops over its expert's rows.

Where torch's own grouped GEMM is the fast path (`torch_grouped_mm_usable`: bf16, sm90/sm100, 16-byte aligned
strides), the ops call it (through `reference.grouped_mm`) instead of these kernels.

Autotune configs for sm90 (H100: 132 SMs, 228 KB shared memory per SM, wgmma on warpgroups of 4 warps):
  * 128 x 256 x 64, 8 warps, 3 stages: 128 x 256 fp32 accumulator = 128 registers per thread over 2 warpgroups;
    (128 + 256) x 64 x 2 B = 48 KB per stage, 144 KB for 3: the highest FLOPs per byte loaded, for large groups
    (Mixtral-like: ~4,000 rows per expert, N = 28,672 or 4,096).
  * 128 x 128 x 64, 8 warps, 4 stages: 32 KB per stage, 128 KB; twice the tiles for the same work, which keeps
    132 SMs busy when N / 256 x tiles would leave a partial last wave.
  * 64 x 128 x 64, 4 warps, 4 stages: one warpgroup, for short groups (Qwen3-30B-A3B-like: E 128, k 8, ~1,000
    rows per expert, N = 1,536 or 2,048), where a 128-row tile would be mostly padding at the group edges.
  * 64 x 64 x 128, 4 warps, 3 stages: small N (the [M, 1] bias products) and decode-sized groups.
GROUP_M = 8 orders the tiles so 8 row tiles sweep a weight column block while it is in L2. The autotune key is
(N, K, rows per expert rounded to a power of 2, dtypes), so a new batch size does not re-tune.
The weight gradient's configs are the same tile shapes over (P, Q) with the group's rows as the reduction.
None of this is measured: the figures are owed until a GPU runs `benchmarks/moe_layer.py --device cuda`.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from .. import reference
from .permute import permute
from .runtime import (
    INTERPRETING, accumulator, cast, check_device, dot_precision, launch, next_power_of_2, upcast_dot,
)


def _config(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m), num_warps=warps,
                         num_stages=stages)


SM90_CONFIGS = [
    _config(128, 256, 64, 8, 3),
    _config(128, 128, 64, 8, 4),
    _config(64, 128, 64, 4, 4),
    _config(64, 64, 128, 4, 3),
]
SM90_WEIGHT_GRAD_CONFIGS = [
    triton.Config(dict(BLOCK_P=128, BLOCK_Q=256, BLOCK_K=64), num_warps=8, num_stages=3),
    triton.Config(dict(BLOCK_P=128, BLOCK_Q=128, BLOCK_K=64), num_warps=8, num_stages=4),
    triton.Config(dict(BLOCK_P=64, BLOCK_Q=128, BLOCK_K=64), num_warps=4, num_stages=4),
    triton.Config(dict(BLOCK_P=64, BLOCK_Q=64, BLOCK_K=128), num_warps=4, num_stages=3),
]
# Under the interpreter: tiles small enough that the tests' small shapes span several tiles, groups and K steps,
# and large enough to keep the programs few (each costs the interpreter milliseconds, whatever its size).
INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)
INTERPRETER_WEIGHT_GRAD_CONFIG = dict(BLOCK_P=32, BLOCK_Q=32, BLOCK_K=32)


def torch_grouped_mm_usable(
    device: torch.device,
    dtypes: tuple[torch.dtype, ...],
    dims: tuple[int, ...],
    capability: tuple[int, int] | None = None,
) -> bool:
    """Whether `torch.nn.functional.grouped_mm` is the fast path for these operands.

    torch 2.13 runs it with CUTLASS for bf16 on sm90 and sm100 (compute capability major 9 or 10); elsewhere it
    falls back to a loop that copies the offsets to the host (a sync), so the Triton kernels run instead. Its
    operands need 16-byte aligned strides: every dimension in `dims` a multiple of 8 bf16 elements.

    Args:
        capability: the device's compute capability; None reads it (tests pass a fake one).
    """
    if not hasattr(torch.nn.functional, "grouped_mm") or device.type != "cuda" or torch.version.hip is not None:
        return False
    if any(dtype != torch.bfloat16 for dtype in dtypes) or any(d % 8 for d in dims):
        return False
    major, _ = capability if capability is not None else torch.cuda.get_device_capability(device)
    return major in (9, 10)


@triton.jit
def _grouped_mm_kernel(
    a_ptr, b_ptr, c_ptr, counts_ptr, gather_ptr, bias_ptr, scale_ptr,
    M, N, K, E, top_k, rows_hint,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias_e, stride_bias_n,
    HAS_GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """c [M, N] = a [M, K] (or a[gather // top_k]) @ b[e] [K, N] per row group, + bias [E, N] (x scale [M]).
    `rows_hint` (rows per expert, rounded) only keys the autotuner."""
    pid = tl.program_id(0)
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    num_m = (M + BLOCK_M - 1) // BLOCK_M + E
    per_sweep = GROUP_M * num_n
    first_m = (pid // per_sweep) * GROUP_M
    sweep_rows = tl.minimum(num_m - first_m, GROUP_M)
    m_tile = first_m + (pid % per_sweep) % sweep_rows
    n_tile = (pid % per_sweep) // sweep_rows
    # The row group of this tile: experts 0..E-1, then the dropped rows as group E (they end at row M); past the
    # last tile, group > E. Inline, and with few tl.sum/cumsum: the interpreter pays ~3 ms per nested jit call.
    e = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0).to(tl.int32)
    row_end = tl.cumsum(counts, axis=0)
    row_start = row_end - counts
    row_end = tl.where(e == E, M, row_end)
    tiles = (row_end - row_start + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    group = tl.sum((tile_end <= m_tile).to(tl.int32), axis=0)
    pick = e == group
    local = m_tile - tl.sum(tl.where(pick, tile_end - tiles, 0), axis=0)  # tile index within the group
    row0 = tl.sum(tl.where(pick, row_start, 0), axis=0) + local * BLOCK_M
    rows_here = tl.sum(tl.where(pick, row_end, 0), axis=0) - row0  # >= BLOCK_M except in the group's last tile
    if group <= E:
        offs_m = tl.arange(0, BLOCK_M)
        rows = row0 + offs_m
        in_rows = offs_m < rows_here
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        in_cols = cols < N
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
        c_mask = in_rows[:, None] & in_cols[None, :]
        if group == E:  # the dropped pairs' rows
            tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        else:
            if HAS_GATHER:
                a_rows = (tl.load(gather_ptr + rows, mask=in_rows, other=0) // top_k).to(tl.int64)
            else:
                a_rows = rows.to(tl.int64)
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
            b_ptrs = b_ptr + group.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
            for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=in_rows[:, None], other=0.0)
                    b = tl.load(b_ptrs, mask=in_cols[None, :], other=0.0)
                else:
                    k_left = K - k * BLOCK_K
                    a = tl.load(a_ptrs, mask=in_rows[:, None] & (offs_k[None, :] < k_left), other=0.0)
                    b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & in_cols[None, :], other=0.0)
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            if HAS_BIAS:
                bias = tl.load(bias_ptr + group * stride_bias_e + cols * stride_bias_n, mask=in_cols, other=0.0)
                bias = bias.to(ACC)[None, :]
                if HAS_SCALE:
                    bias = bias * tl.load(scale_ptr + rows, mask=in_rows, other=0.0).to(ACC)[:, None]
                acc += bias
            tl.store(c_ptrs, cast(acc, c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _grouped_mm_weight_grad_kernel(
    a_ptr, b_ptr, c_ptr, counts_ptr, gather_ptr, M, P, Q, E, top_k, rows_hint,
    stride_am, stride_ap, stride_bm, stride_bq, stride_ce, stride_cp, stride_cq,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr,
    PRECISION: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c [E, P, Q]: c[e] = a[g_e]^T @ b[g_e] over expert e's rows g_e; a [M, P], b [M, Q], either read through
    `gather // top_k`."""
    pid = tl.program_id(0)
    group = tl.program_id(1)
    num_q = (Q + BLOCK_Q - 1) // BLOCK_Q
    ps = (pid // num_q) * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = (pid % num_q) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    in_p = ps < P
    in_q = qs < Q
    e = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0).to(tl.int32)
    start = tl.sum(tl.where(e < group, counts, 0), axis=0)
    size = tl.sum(tl.where(e == group, counts, 0), axis=0)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=ACC)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, size, BLOCK_K):
        rows = start + k0 + offs_k
        in_rows = k0 + offs_k < size
        if GATHER_A:
            a_rows = (tl.load(gather_ptr + rows, mask=in_rows, other=0) // top_k).to(tl.int64)
        else:
            a_rows = rows.to(tl.int64)
        if GATHER_B:
            b_rows = (tl.load(gather_ptr + rows, mask=in_rows, other=0) // top_k).to(tl.int64)
        else:
            b_rows = rows.to(tl.int64)
        a = tl.load(a_ptr + a_rows[None, :] * stride_am + ps[:, None] * stride_ap,
                    mask=in_p[:, None] & in_rows[None, :], other=0.0)  # [BLOCK_P, BLOCK_K]: a^T
        b = tl.load(b_ptr + b_rows[:, None] * stride_bm + qs[None, :] * stride_bq,
                    mask=in_rows[:, None] & in_q[None, :], other=0.0)  # [BLOCK_K, BLOCK_Q]
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    c_ptrs = c_ptr + group.to(tl.int64) * stride_ce + ps[:, None] * stride_cp + qs[None, :] * stride_cq
    tl.store(c_ptrs, cast(acc, c_ptr.dtype.element_ty), mask=in_p[:, None] & in_q[None, :])


def _rows_hint(m: int, num_experts: int) -> int:
    """Rows per expert rounded to a power of 2 in [16, 8192]: the autotune key's stand-in for M."""
    return min(max(next_power_of_2(m // max(num_experts, 1)), 16), 8192)


_TUNED: dict[str, object] = {}


def tuned(kernel_name: str):
    """The autotuned launcher of "grouped_mm" or "weight_grad". On a GPU triton times each config; under the
    interpreter (tests) each config runs once, timed on the host: the choice means nothing, the path runs."""
    if kernel_name not in _TUNED:
        _TUNED[kernel_name] = _autotune(kernel_name, _host_bench if INTERPRETING else None)
    return _TUNED[kernel_name]


def _host_bench(fn, quantiles=None, **_):
    start = time.perf_counter()
    fn()
    ms = (time.perf_counter() - start) * 1e3
    return [ms] * len(quantiles) if quantiles else ms


def _autotune(kernel_name: str, do_bench):
    if kernel_name == "grouped_mm":
        even_k = triton.heuristics(dict(EVEN_K=lambda args: args["K"] % args["BLOCK_K"] == 0))(_grouped_mm_kernel)
        return triton.autotune(SM90_CONFIGS, key=["N", "K", "rows_hint"], do_bench=do_bench)(even_k)
    return triton.autotune(SM90_WEIGHT_GRAD_CONFIGS, key=["P", "Q", "rows_hint"], do_bench=do_bench)(
        _grouped_mm_weight_grad_kernel
    )


def _grid(m: int, n: int, num_experts: int, block_m: int, block_n: int) -> tuple[int]:
    """Programs for the worst case: each group adds at most one partial row tile (the dropped rows are group E)."""
    return ((triton.cdiv(m, block_m) + num_experts) * triton.cdiv(n, block_n),)


def _weight_grad_grid(p: int, q: int, num_experts: int, block_p: int, block_q: int) -> tuple[int, int]:
    return triton.cdiv(p, block_p) * triton.cdiv(q, block_q), num_experts


def _gathered(x: torch.Tensor, gather_index: torch.Tensor | None, top_k: int) -> torch.Tensor:
    return x if gather_index is None else permute(x, gather_index, top_k)


def grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    bias: torch.Tensor | None,
    bias_scale: torch.Tensor | None,
    transpose_weight: bool,
    gather_index: torch.Tensor | None = None,
    top_k: int = 1,
    config: dict | None = None,
) -> torch.Tensor:
    """`reference.grouped_mm`, optionally reading its rows through `gather_index`.

    Args:
        x: [M, K] rows sorted by expert, or, with `gather_index` [M], the [N, K] tokens (row r = x[gather_index[r]
            // top_k]).
        weight: [E, A, B]; y = x @ weight[e]^T (A out, `transpose_weight`) or x @ weight[e] (B out).
        tokens_per_expert: [E] group sizes (on the device; never read on the host).
        bias: [E, out], added to each row of expert e, times `bias_scale` [M] when given.
        config: the kernel's meta-parameters (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M and optionally num_warps,
            num_stages), or "autotune"; None: the autotuner on a GPU, `INTERPRETER_CONFIG` under the interpreter.
    Returns:
        [M, out]; rows past the last group are zero.
    """
    device = check_device(x, weight, tokens_per_expert, bias, bias_scale, gather_index)
    w = weight.transpose(-2, -1) if transpose_weight else weight  # [E, K, out]
    m = gather_index.shape[0] if gather_index is not None else x.shape[0]
    num_experts, k, n = w.shape
    if x.shape[1] != k or x.dtype != weight.dtype:
        raise ValueError(f"grouped_mm: x is {tuple(x.shape)} {x.dtype}, the weights {tuple(weight.shape)} {weight.dtype} "
                         f"(transpose_weight={transpose_weight}); they need the same dtype and x {k} columns.")
    if torch_grouped_mm_usable(device, (x.dtype, weight.dtype), (k, n)):
        return reference.grouped_mm(_gathered(x, gather_index, top_k), weight, tokens_per_expert, bias, bias_scale,
                                    transpose_weight)
    out = x.new_empty(m, n)
    if m == 0 or n == 0:
        return out
    dummy = out  # pointer for absent operands; never read
    args = (
        x, w, out, tokens_per_expert, gather_index if gather_index is not None else dummy,
        bias if bias is not None else dummy, bias_scale if bias_scale is not None else dummy,
        m, n, k, num_experts, top_k, _rows_hint(m, num_experts),
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
    )
    flags = dict(
        HAS_GATHER=gather_index is not None, HAS_BIAS=bias is not None, HAS_SCALE=bias_scale is not None,
        UPCAST=upcast_dot(x.dtype), ACC=accumulator(x.dtype), PRECISION=dot_precision(x.dtype),
        E_POW2=next_power_of_2(num_experts + 1),
    )
    if config == "autotune" or (config is None and not INTERPRETING):
        kernel = tuned("grouped_mm")
        launch(kernel, lambda meta: _grid(m, n, num_experts, meta["BLOCK_M"], meta["BLOCK_N"]), device, *args, **flags)
        return out
    config = config or INTERPRETER_CONFIG
    grid = _grid(m, n, num_experts, config["BLOCK_M"], config["BLOCK_N"])
    launch(_grouped_mm_kernel, grid, device, *args, EVEN_K=k % config["BLOCK_K"] == 0, **flags, **config)
    return out


def grouped_mm_weight_grad(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    gather_index: torch.Tensor | None = None,
    top_k: int = 1,
    gather: str = "",
    config: dict | None = None,
) -> torch.Tensor:
    """`reference.grouped_mm_weight_grad`: [E, A, B], grad_out[g]^T @ x[g] for each expert's row group g (zero for
    experts without rows).

    Args:
        grad_out: [M, A]; x: [M, B]. With `gather_index` [M], the operand named by `gather` ("grad_out" or "x")
            is given in token order ([N, .]) and read through gather_index // top_k.
        config: meta-parameters (BLOCK_P, BLOCK_Q, BLOCK_K, optionally num_warps, num_stages), "autotune", or None,
            as in `grouped_mm`.
    """
    device = check_device(grad_out, x, tokens_per_expert, gather_index)
    if (gather_index is not None) != (gather in ("grad_out", "x")):
        raise ValueError(f"grouped_mm_weight_grad: gather must name 'grad_out' or 'x' with a gather_index, and be "
                         f"'' without one; got gather={gather!r} and gather_index="
                         f"{'a tensor' if gather_index is not None else 'None'}.")
    if grad_out.dtype != x.dtype:
        raise ValueError(f"grouped_mm_weight_grad: grad_out is {grad_out.dtype}, x {x.dtype}; they need one dtype.")
    gather_a, gather_b = gather == "grad_out", gather == "x"
    m = gather_index.shape[0] if gather_index is not None else grad_out.shape[0]
    num_experts, p, q = tokens_per_expert.shape[0], grad_out.shape[1], x.shape[1]
    if torch_grouped_mm_usable(device, (grad_out.dtype, x.dtype), (p, q)):
        a = _gathered(grad_out, gather_index if gather_a else None, top_k)
        b = _gathered(x, gather_index if gather_b else None, top_k)
        return reference.grouped_mm_weight_grad(a, b, tokens_per_expert)
    out = x.new_empty(num_experts, p, q)
    if out.numel() == 0:
        return out
    args = (
        grad_out, x, out, tokens_per_expert, gather_index if gather_index is not None else out,
        m, p, q, num_experts, top_k, _rows_hint(m, num_experts),
        grad_out.stride(0), grad_out.stride(1), x.stride(0), x.stride(1), out.stride(0), out.stride(1), out.stride(2),
    )
    flags = dict(
        GATHER_A=gather_a, GATHER_B=gather_b, UPCAST=upcast_dot(x.dtype), ACC=accumulator(x.dtype),
        PRECISION=dot_precision(x.dtype), E_POW2=next_power_of_2(num_experts),
    )
    if config == "autotune" or (config is None and not INTERPRETING):
        grid = lambda meta: _weight_grad_grid(p, q, num_experts, meta["BLOCK_P"], meta["BLOCK_Q"])  # noqa: E731
        launch(tuned("weight_grad"), grid, device, *args, **flags)
        return out
    config = config or INTERPRETER_WEIGHT_GRAD_CONFIG
    grid = _weight_grad_grid(p, q, num_experts, config["BLOCK_P"], config["BLOCK_Q"])
    launch(_grouped_mm_weight_grad_kernel, grid, device, *args, **flags, **config)
    return out
