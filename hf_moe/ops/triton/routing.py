"""The routing plan on the device: per-expert counts and the stable permutation that groups the (token, slot)
pairs by expert, with no device-to-host sync (every size is known from the shapes).

A counting sort in three kernels. Slots are cut into blocks of `BLOCK` consecutive slot ids; bucket E holds the
dropped pairs (ids outside [0, E)), so they sort after every group, as in `reference.sort_by_expert`.

  1. `_route_rank_kernel`, one program per block: each slot's rank among the earlier slots of its block with the
     same bucket (a [BLOCK, BLOCK] comparison), and the block's count per bucket.
  2. `_route_scan_kernel`, one program: over the [blocks, E + 1] counts, each block's exclusive prefix within its
     bucket, each bucket's total, and each bucket's first row (exclusive prefix of the totals).
  3. `_route_scatter_kernel`, one program per block: row = bucket start + block prefix + rank; writes both
     directions of the permutation.

Row order inside a bucket is slot order (blocks in order, then ranks in order): the stable sort.

Block sizes (sm90): BLOCK = 128 slots with 4 warps keeps the [128, 128] comparison at 128 values per thread. The
scan is one program because its input is small: [M / 128, E + 1] int32, 0.5 MB for 16,384 tokens x k 8 and
E 128, read once in [64, 128] tiles; a multi-program scan would need a second pass for the bucket starts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import INTERPRETING, check_device, launch, next_power_of_2

# (slots per block, scan tile rows, scan tile buckets); the interpreter's are smaller so tests cross blocks.
GPU_BLOCKS = dict(BLOCK=128, SCAN_ROWS=64, SCAN_COLS=128)
INTERPRETER_BLOCKS = dict(BLOCK=16, SCAN_ROWS=4, SCAN_COLS=8)


@triton.jit
def _route_rank_kernel(index_ptr, rank_ptr, block_counts_ptr, M, E, BLOCK: tl.constexpr):
    """index [M] expert ids -> rank [M] int32 (within block and bucket), block_counts [blocks, E + 1] (zeroed)."""
    block = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    slot = block * BLOCK + i
    valid = slot < M
    ids = tl.load(index_ptr + slot, mask=valid, other=0)
    bucket = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
    bucket = tl.where(valid, bucket, E + 1)  # padding slots: a bucket of their own, never stored
    same = bucket[:, None] == bucket[None, :]  # [BLOCK, BLOCK]
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    tl.store(rank_ptr + slot, rank, mask=valid)
    # Every slot of a bucket writes the same count to the same place.
    tl.store(block_counts_ptr + block * (E + 1) + bucket, count, mask=valid)


@triton.jit
def _route_scan_kernel(
    block_counts_ptr, bucket_start_ptr, counts_ptr, num_blocks, E, SCAN_ROWS: tl.constexpr, SCAN_COLS: tl.constexpr
):
    """block_counts [blocks, E + 1] -> in place: each block's exclusive prefix within its bucket.
    Also bucket_start [E + 1] int32 (first row of each bucket) and counts [E] int64 (tokens per expert)."""
    before = 0  # rows of the buckets before this tile of buckets
    for col0 in range(0, E + 1, SCAN_COLS):
        cols = col0 + tl.arange(0, SCAN_COLS)
        in_cols = cols < E + 1
        total = tl.zeros((SCAN_COLS,), dtype=tl.int32)
        for row0 in range(0, num_blocks, SCAN_ROWS):
            rows = row0 + tl.arange(0, SCAN_ROWS)
            mask = (rows[:, None] < num_blocks) & in_cols[None, :]
            ptrs = block_counts_ptr + rows[:, None] * (E + 1) + cols[None, :]
            c = tl.load(ptrs, mask=mask, other=0)
            tl.store(ptrs, tl.cumsum(c, axis=0) - c + total[None, :], mask=mask)
            total += tl.sum(c, axis=0)
        tl.store(bucket_start_ptr + cols, before + tl.cumsum(total, axis=0) - total, mask=in_cols)
        tl.store(counts_ptr + cols, total.to(tl.int64), mask=cols < E)
        before += tl.sum(total, axis=0)


@triton.jit
def _route_scatter_kernel(
    index_ptr, rank_ptr, block_prefix_ptr, bucket_start_ptr, sorted_slots_ptr, slot_to_row_ptr, M, E,
    BLOCK: tl.constexpr,
):
    """-> sorted_slots [M] and slot_to_row [M] (int64): the row of each slot, and the slot of each row."""
    block = tl.program_id(0)
    slot = block * BLOCK + tl.arange(0, BLOCK)
    valid = slot < M
    ids = tl.load(index_ptr + slot, mask=valid, other=0)
    bucket = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
    row = (
        tl.load(bucket_start_ptr + bucket, mask=valid, other=0)
        + tl.load(block_prefix_ptr + block * (E + 1) + bucket, mask=valid, other=0)
        + tl.load(rank_ptr + slot, mask=valid, other=0)
    ).to(tl.int64)
    tl.store(slot_to_row_ptr + slot, row, mask=valid)
    tl.store(sorted_slots_ptr + row, slot.to(tl.int64), mask=valid)


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int, blocks: dict | None = None):
    """`reference.sort_by_expert` on the device, in three launches.

    Args:
        top_k_index: [N, k] expert ids (any integer dtype); ids outside [0, E) are dropped pairs.
        blocks: block sizes (`GPU_BLOCKS`, `INTERPRETER_BLOCKS`); None picks by where the kernels run.
    Returns:
        sorted_slots [M] int64, slot_to_row [M] int64, tokens_per_expert [E] int64.
    """
    device = check_device(top_k_index)
    blocks = blocks or (INTERPRETER_BLOCKS if INTERPRETING else GPU_BLOCKS)
    flat = top_k_index.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        flat = flat.long()
    flat = flat.contiguous()
    m, e = flat.numel(), int(num_experts)
    long = dict(dtype=torch.int64, device=device)
    sorted_slots, slot_to_row = torch.empty(m, **long), torch.empty(m, **long)
    counts = torch.empty(e, **long)
    num_blocks = triton.cdiv(m, blocks["BLOCK"])
    rank = torch.empty(m, dtype=torch.int32, device=device)
    block_counts = torch.zeros(num_blocks, e + 1, dtype=torch.int32, device=device)
    bucket_start = torch.empty(e + 1, dtype=torch.int32, device=device)
    if m:
        launch(_route_rank_kernel, (num_blocks,), device, flat, rank, block_counts, m, e, BLOCK=blocks["BLOCK"])
    launch(
        _route_scan_kernel, (1,), device, block_counts, bucket_start, counts, num_blocks, e,
        SCAN_ROWS=blocks["SCAN_ROWS"], SCAN_COLS=min(blocks["SCAN_COLS"], next_power_of_2(e + 1)),
    )
    if m:
        launch(
            _route_scatter_kernel, (num_blocks,), device, flat, rank, block_counts, bucket_start, sorted_slots,
            slot_to_row, m, e, BLOCK=blocks["BLOCK"],
        )
    return sorted_slots, slot_to_row, counts
