"""Transparent huge pages for the weights a CPU decode step streams (Linux).

A decode step reads every weight it uses once, from memory: the quickstart's model streams 409 MiB per token, so the
step runs at the speed memory is read. Read through 4 KiB pages, every 4 KiB of weights costs a TLB entry; through
2 MiB pages, 512 times fewer, so memory is read faster and the one-op decode step (hf_moe.decode_one_op) that
streams the weights runs faster with them on huge pages (docs/serving-cpu.md, "Huge pages", has the measurements).

Where transparent huge pages are left to `madvise` (the usual default), nothing backs a tensor's memory with them
unless asked. `back_with_huge_pages` asks for the 2 MiB-aligned interior of each tensor's storage: MADV_HUGEPAGE
(later faults there take huge pages) and MADV_COLLAPSE (Linux 6.1+: the pages already there are gathered into huge
pages now, by the kernel copying them). Contents, addresses and sharing do not change; where the kernel declines
(an older kernel, huge pages disabled, memory it cannot collapse), the pages stay as they were. The first call on a
model's weights pays for that copy (its cost per GiB is in docs/serving-cpu.md); later calls find them done.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <asm-generic/mman-common.h>


@functools.cache
def _madvise():
    """libc's madvise(addr, length, advice) -> int, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def back_with_huge_pages(tensors) -> int:
    """Ask the kernel to back the CPU storages of `tensors` with transparent huge pages, now (module docstring).
    Returns the bytes it collapsed into huge pages: 2 MiB-aligned ranges inside storages of at least 2 MiB, each
    storage once; 0 where the kernel declined or there is no such range."""
    madvise = _madvise()
    if madvise is None:
        return 0
    done, seen = 0, set()
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        if start in seen:
            continue
        seen.add(start)
        first, end = -(-start // HUGE_PAGE) * HUGE_PAGE, (start + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
        if end <= first:
            continue
        madvise(first, end - first, MADV_HUGEPAGE)
        if madvise(first, end - first, MADV_COLLAPSE) == 0:
            done += end - first
    return done
