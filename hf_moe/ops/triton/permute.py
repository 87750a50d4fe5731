"""Moving rows between token order and expert order: the gather before the experts and the combine after.

    permute:    [N, H] -> [M, H]   row r = hidden_states[sorted_slots[r] // k]
    unpermute:  [M, H] -> [N, H]   out[n] = sum_j w[n, j] * rows[slot_to_row[n * k + j]]   (w = 1 when None)

Both are memory bound: a program moves a [BLOCK_R, BLOCK_H] tile; rows are gathered whole, so every load is a
contiguous run of BLOCK_H elements. The combine accumulates in fp32 (fp64 for fp64) and rounds once.
The grouped GEMM can gather its input rows itself (`grouped_gemm.grouped_mm(..., gather_index=)`), which skips
`permute` and its [M, H] copy on the forward and in the backward.

Block sizes (sm90): [32, 128] tiles with 4 warps: 8 KB of bf16 per program in flight, 32 values per thread;
the H axis is split over programs, so a short N still fills the 132 SMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import INTERPRETING, accumulator, cast, check_device, launch

GPU_BLOCKS = dict(BLOCK_R=32, BLOCK_H=128, num_warps=4)
INTERPRETER_BLOCKS = dict(BLOCK_R=16, BLOCK_H=32)


def _blocks(blocks):
    return blocks or (INTERPRETER_BLOCKS if INTERPRETING else GPU_BLOCKS)


@triton.jit
def _permute_kernel(
    x_ptr, sorted_slots_ptr, out_ptr, M, H, top_k, stride_xn, stride_xh,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """x [N, H] (any strides), sorted_slots [M] -> out [M, H] contiguous."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_rows = rows < M
    token = tl.load(sorted_slots_ptr + rows, mask=in_rows, other=0) // top_k
    mask = in_rows[:, None] & (cols[None, :] < H)
    values = tl.load(x_ptr + token[:, None] * stride_xn + cols[None, :] * stride_xh, mask=mask)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], values, mask=mask)


@triton.jit
def _unpermute_kernel(
    rows_ptr, slot_to_row_ptr, weights_ptr, out_ptr, N, H, top_k, stride_rm, stride_rh, stride_wn, stride_wk,
    HAS_WEIGHTS: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """rows [M, H], slot_to_row [M], weights [N, k] or None -> out [N, H] contiguous."""
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_tokens = tokens < N
    mask = in_tokens[:, None] & (cols[None, :] < H)
    acc = tl.zeros((BLOCK_R, BLOCK_H), dtype=ACC)
    for j in range(0, top_k):
        row = tl.load(slot_to_row_ptr + tokens.to(tl.int64) * top_k + j, mask=in_tokens, other=0)
        values = tl.load(rows_ptr + row[:, None] * stride_rm + cols[None, :] * stride_rh, mask=mask, other=0.0)
        values = values.to(ACC)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + tokens * stride_wn + j * stride_wk, mask=in_tokens, other=0.0)
            values = values * w.to(ACC)[:, None]
        acc += values
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * H + cols[None, :], cast(acc, out_ptr.dtype.element_ty), mask=mask)


def permute(hidden_states: torch.Tensor, sorted_slots: torch.Tensor, top_k: int, blocks: dict | None = None):
    """`reference.permute`: [N, H] -> [M, H], row r holding the token of slot `sorted_slots[r]`."""
    device = check_device(hidden_states, sorted_slots)
    blocks = _blocks(blocks)
    m, h = sorted_slots.shape[0], hidden_states.shape[1]
    out = hidden_states.new_empty(m, h)
    if m and h:
        grid = (triton.cdiv(m, blocks["BLOCK_R"]), triton.cdiv(h, blocks["BLOCK_H"]))
        launch(
            _permute_kernel, grid, device, hidden_states, sorted_slots.contiguous(), out, m, h, top_k,
            hidden_states.stride(0), hidden_states.stride(1), **blocks,
        )
    return out


def unpermute(
    rows: torch.Tensor, slot_to_row: torch.Tensor, top_k_weights: torch.Tensor | None, top_k: int,
    blocks: dict | None = None,
):
    """`reference.unpermute`: [M, H] -> [N, H], out[n] = sum_j w[n, j] * rows[slot_to_row[n*k + j]]."""
    device = check_device(rows, slot_to_row, top_k_weights)
    blocks = _blocks(blocks)
    n, h = slot_to_row.shape[0] // top_k, rows.shape[1]
    out = rows.new_empty(n, h)
    if n and h:
        w = top_k_weights if top_k_weights is not None else rows  # a placeholder pointer, never read
        w_strides = (w.stride(0), w.stride(1)) if top_k_weights is not None else (0, 0)
        grid = (triton.cdiv(n, blocks["BLOCK_R"]), triton.cdiv(h, blocks["BLOCK_H"]))
        launch(
            _unpermute_kernel, grid, device, rows, slot_to_row.contiguous(), w, out, n, h, top_k, rows.stride(0),
            rows.stride(1), *w_strides, HAS_WEIGHTS=top_k_weights is not None, ACC=accumulator(rows.dtype),
            **blocks,
        )
    return out
