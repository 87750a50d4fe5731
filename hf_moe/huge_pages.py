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

A storage smaller than a few huge pages keeps most of its bytes outside any 2 MiB-aligned range: the quickstart's
attention weights (1.7 MiB a layer, in four tensors) stay on 4 KiB pages however they are asked. `copies_on_huge_pages`
gives such tensors copies side by side in one buffer asked onto huge pages before its first write; the one-op step
(hf_moe.decode_one_op) reads its layers' small weights there.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <asm-generic/mman-common.h>
SMALL = 4 * HUGE_PAGE  # a storage under this keeps a large share of its bytes on 4 KiB pages (module docstring)
ALIGN = 64  # each copy of `copies_on_huge_pages` starts on a cache line


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


def copies_on_huge_pages(groups: list[dict], budget: int) -> tuple[list[dict], torch.Tensor | None]:
    """Copies of the small tensors of `groups` (dicts of name -> tensor or None) side by side in one buffer on huge
    pages (module docstring), and that buffer (None: nothing copied). A tensor is copied if it is a contiguous CPU
    tensor whose storage is under `SMALL` bytes, while the copies fit in `budget` bytes; one tensor named twice gets
    one copy. The other tensors, and every tensor where huge pages are not offered (off Linux, or disabled), are
    returned as they were.

    The copies are the caller's: they do not follow later writes to the originals, and need no gradient."""
    madvise = _madvise() if offered() else None
    chosen: dict[int, torch.Tensor] = {}
    used = 0
    for group in groups if madvise is not None else ():
        for t in group.values():
            if (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and id(t) not in chosen
                    and t.untyped_storage().nbytes() < SMALL and used + _padded(t) <= budget):
                chosen[id(t)] = t
                used += _padded(t)
    if not chosen:
        return groups, None
    buffer = torch.empty(used + HUGE_PAGE, dtype=torch.uint8)
    start = buffer.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    madvise(first, used, MADV_HUGEPAGE)  # before the first write: its page faults take huge pages
    offset, copies = first - start, {}
    with torch.no_grad():
        for key, t in chosen.items():
            nbytes = t.numel() * t.element_size()
            copies[key] = buffer[offset:offset + nbytes].view(t.dtype).view(t.shape).copy_(t)
            offset += _padded(t)
    back_with_huge_pages([buffer])  # whatever faulted in as 4 KiB pages after all
    return [{name: copies.get(id(t), t) for name, t in group.items()} for group in groups], buffer


@functools.cache
def offered() -> bool:
    """Whether this kernel offers transparent huge pages (sysfs says so, and not `never`)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _padded(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN
