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

Where torch's own grouped GEMM is the fast path (`reference.torch_grouped_mm_usable`: bf16 on sm90 with 16-byte
aligned strides), the ops call it (through `reference.grouped_mm`) unless `torch_gemm=False` asks for these kernels.

Autotuning (configs.py: tile shapes per dtype, fitted to the device's shared memory) happens on the first launch of
each key: (N, K, rows per expert rounded to a power of 2, strides, dot precision, dtypes), so a new batch size does
not re-tune. It times every config, which must not happen inside a CUDA-graph capture (and is better done before
the first training step): `hf_moe.ops.warmup(model, tokens=...)` runs the layers once to tune them. A launch during
capture whose key was never tuned runs the first config untuned, after one warning.
"""

from __future__ import annotations

import time
import warnings

import torch
import triton
import triton.language as tl

from ..reference import grouped_mm as torch_grouped_mm
from ..reference import grouped_mm_weight_grad as torch_grouped_mm_weight_grad
from ..reference import torch_grouped_mm_usable
from .configs import (
    EVERY, TENSOR_CORE, TENSOR_CORE_WEIGHT_GRAD, aligned_strides, configs_for, device_shared_memory, pruner,
)
from .permute import permute
from .runtime import (
    INTERPRETING, accumulator, cast, check_device, dot_precision, launch, next_power_of_2, upcast_dot,
)


SM90_CONFIGS = TENSOR_CORE  # the bf16 configs (kept under their old names)
SM90_WEIGHT_GRAD_CONFIGS = TENSOR_CORE_WEIGHT_GRAD
# Under the interpreter: tiles small enough that the tests' small shapes span several tiles, groups and K steps,
# and large enough to keep the programs few (each costs the interpreter milliseconds, whatever its size).
INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)
INTERPRETER_WEIGHT_GRAD_CONFIG = dict(BLOCK_P=32, BLOCK_Q=32, BLOCK_K=32)
# Whether a launch without an explicit config autotunes (on a GPU) or runs the interpreter's config (tests set it
# to exercise the autotuned path under the interpreter).
USE_AUTOTUNER = not INTERPRETING
# Whether the ops hand their GEMMs to torch's grouped_mm where it is the fast path (bf16 on sm90). gpu_check turns it
# off to run these kernels there too.
TORCH_GEMM = True


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
    # last tile, group > E. Inline, and with few tl.sum/cumsum: each nested jit call is slow under the interpreter.
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


_KERNELS = {"grouped_mm": _grouped_mm_kernel, "weight_grad": _grouped_mm_weight_grad_kernel}
_KEYS = {  # besides these, triton's autotuner keys on the dtypes of the tensor arguments
    "grouped_mm": ["N", "K", "rows_hint", "stride_am", "stride_bk", "stride_bn", "PRECISION"],
    "weight_grad": ["P", "Q", "rows_hint", "stride_am", "stride_bm", "PRECISION"],
}
_TUNED: dict[str, object] = {}
tuned_keys: set[tuple] = set()  # (kernel, our key) of every autotuned launch in this process: the tuner has timed it
bench_calls: list[str] = []  # under the interpreter, the kernel of each config timed (tests count them)
_warned_capture: set[str] = set()


def tuned(kernel_name: str):
    """The autotuned launcher of "grouped_mm" or "weight_grad". On a GPU triton times each config; under the
    interpreter (tests) each config runs once, timed on the host: the choice means nothing, the path runs."""
    if kernel_name not in _TUNED:
        do_bench = _HostBench(kernel_name) if INTERPRETING else None  # None: triton's own timing
        even_k = _KERNELS[kernel_name]
        if kernel_name == "grouped_mm":
            even_k = triton.heuristics(dict(EVEN_K=lambda args: args["K"] % args["BLOCK_K"] == 0))(even_k)
        _TUNED[kernel_name] = triton.autotune(EVERY[kernel_name], key=_KEYS[kernel_name], do_bench=do_bench,
                                              prune_configs_by=dict(early_config_prune=pruner(kernel_name)))(
            even_k)
    return _TUNED[kernel_name]


class _HostBench:
    """Under the interpreter: run the config once, timed on the host."""

    def __init__(self, kernel_name: str):
        self.kernel_name = kernel_name

    def __call__(self, fn, quantiles=None, **_):
        bench_calls.append(self.kernel_name)
        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        return [ms] * len(quantiles) if quantiles else ms


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _launch_autotuned(name: str, grid, device: torch.device, args: tuple, flags: dict, key: tuple,
                      strides: dict) -> None:
    """Launch the autotuned kernel; during a CUDA-graph capture, a key never tuned runs the first config untuned.
    `strides`: the operands' row strides by argument name (configs.ROW_STRIDES)."""
    if (name, key) in tuned_keys or not _capturing(device):
        launch(tuned(name), grid, device, *args, **flags)
        tuned_keys.add((name, key))
        return
    x = args[0]
    config = configs_for(name, x.dtype, flags["PRECISION"], device_shared_memory(device),
                         aligned_strides(name, strides))[0]
    if name not in _warned_capture:
        _warned_capture.add(name)
        warnings.warn(
            f"hf_moe: the Triton {name} GEMM met a new shape during CUDA-graph capture, where autotuning cannot run; "
            f"running {config} untuned. Call hf_moe.ops.warmup(model, tokens=...) before capturing.",
            RuntimeWarning, stacklevel=4,
        )
    meta = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    if name == "grouped_mm":
        meta["EVEN_K"] = args[9] % meta["BLOCK_K"] == 0  # K
    launch(_KERNELS[name], grid(meta), device, *args, **flags, **meta)


def _key(*values) -> tuple:
    return tuple(str(v) if isinstance(v, torch.dtype) else v for v in values)


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
    torch_gemm: bool | None = None,
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
        torch_gemm: run torch's grouped_mm (True) or this kernel (False); None: torch's where it is the fast path
            (and `TORCH_GEMM`).
    Returns:
        [M, out]; rows past the last group are zero.
    """
    device = check_device(x, weight, tokens_per_expert, bias, bias_scale, gather_index)
    w = weight.transpose(-2, -1) if transpose_weight else weight  # [E, K, out]
    m = gather_index.shape[0] if gather_index is not None else x.shape[0]
    num_experts, k, n = w.shape
    if x.shape[1] != k or x.dtype != weight.dtype:
        raise ValueError(f"grouped_mm: x is {tuple(x.shape)} {x.dtype}, the weights {tuple(weight.shape)} "
                         f"{weight.dtype} (transpose_weight={transpose_weight}); they need the same dtype and x {k} "
                         "columns.")
    if torch_gemm is None:
        torch_gemm = TORCH_GEMM and torch_grouped_mm_usable(device, (x.dtype, weight.dtype), (k, n))
    if torch_gemm:
        return torch_grouped_mm(_gathered(x, gather_index, top_k), weight, tokens_per_expert, bias, bias_scale,
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
    if config == "autotune" or (config is None and USE_AUTOTUNER):
        key = _key(n, k, args[12], x.stride(0), w.stride(1), w.stride(2), flags["PRECISION"], x.dtype, w.dtype,
                   bias is not None, bias_scale is not None)
        grid = lambda meta: _grid(m, n, num_experts, meta["BLOCK_M"], meta["BLOCK_N"])  # noqa: E731
        strides = dict(stride_am=x.stride(0), stride_bk=w.stride(1), stride_bn=w.stride(2))
        _launch_autotuned("grouped_mm", grid, device, args, flags, key, strides)
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
    torch_gemm: bool | None = None,
) -> torch.Tensor:
    """`reference.grouped_mm_weight_grad`: [E, A, B], grad_out[g]^T @ x[g] for each expert's row group g (zero for
    experts without rows).

    Args:
        grad_out: [M, A]; x: [M, B]. With `gather_index` [M], the operand named by `gather` ("grad_out" or "x")
            is given in token order ([N, .]) and read through gather_index // top_k.
        config, torch_gemm: as in `grouped_mm` (config keys BLOCK_P, BLOCK_Q, BLOCK_K).
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
    if torch_gemm is None:
        torch_gemm = TORCH_GEMM and torch_grouped_mm_usable(device, (grad_out.dtype, x.dtype), (p, q))
    if torch_gemm:
        a = _gathered(grad_out, gather_index if gather_a else None, top_k)
        b = _gathered(x, gather_index if gather_b else None, top_k)
        return torch_grouped_mm_weight_grad(a, b, tokens_per_expert)
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
    if config == "autotune" or (config is None and USE_AUTOTUNER):
        key = _key(p, q, args[10], grad_out.stride(0), x.stride(0), flags["PRECISION"], x.dtype)
        grid = lambda meta: _weight_grad_grid(p, q, num_experts, meta["BLOCK_P"], meta["BLOCK_Q"])  # noqa: E731
        strides = dict(stride_am=grad_out.stride(0), stride_bm=x.stride(0))
        _launch_autotuned("weight_grad", grid, device, args, flags, key, strides)
        return out
    config = config or INTERPRETER_WEIGHT_GRAD_CONFIG
    grid = _weight_grad_grid(p, q, num_experts, config["BLOCK_P"], config["BLOCK_Q"])
    launch(_grouped_mm_weight_grad_kernel, grid, device, *args, **flags, **config)
    return out
