"""How much memory is left, and byte counts for messages: what the size checks before an allocation compare with
(a conversion's, `hf_moe.convert.estimate`; a static KV cache's, `hf_moe.generation`). A leaf: imports nothing of
hf_moe."""

from __future__ import annotations

import os

# Set to 1, it lets a request past the size checks (a compressing filesystem, swap, a quota the numbers do not show).
SKIP_VARIABLE = "HF_MOE_SKIP_SIZE_CHECK"


def size_check_skipped() -> bool:
    return os.environ.get(SKIP_VARIABLE, "").strip().lower() in ("1", "true", "yes")


def available_memory() -> int | None:
    """Bytes of host memory this process may still take: the kernel's MemAvailable, or less under a cgroup (v2)
    limit; None where neither can be read."""
    available = None
    try:
        with open("/proc/meminfo") as f:  # (not a checkpoint's file)
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            room = max(int(limit) - used, 0)
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def free_memory(device) -> int | None:
    """Bytes free on `device` (a torch.device) for a new tensor: the GPU's free memory, or the host's available memory
    (`available_memory`); None where it is not known."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    return available_memory() if device.type == "cpu" else None


def format_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError
