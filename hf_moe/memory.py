"""How much memory is left, and byte counts for messages: what the size checks before an allocation compare with
(a conversion's, `hf_moe.convert.estimate`; a static KV cache's, `hf_moe.generation`). A leaf: imports nothing of
hf_moe."""

from __future__ import annotations

import os

# Set to 1, it lets a request past the size checks (a compressing filesystem, swap, a quota the numbers do not show).
SKIP_VARIABLE = "HF_MOE_SKIP_SIZE_CHECK"


def size_check_skipped() -> bool:
    return os.environ.get(SKIP_VARIABLE, "").strip().lower() in ("1", "true", "yes")


# A limit at or above this is "no limit": cgroup v1 reads back an unset limit as the largest page count times the page
# size (9223372036854771712 with 4 KiB pages, a little less with larger pages), never as a word.
_UNLIMITED = 1 << 60


def available_memory(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of host memory this process may still take: the kernel's MemAvailable, or less where a memory cgroup
    (v1 or v2) holding this process leaves less room; None where neither can be read. `proc` and `cgroup_root` are
    where procfs and the cgroup filesystems are mounted (tests point them at fake trees)."""
    available = None
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    room = cgroup_room(proc, cgroup_root)
    if room is not None:
        available = room if available is None else min(available, room)
    return available


def cgroup_room(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes the memory cgroups holding this process leave before their limit: the least room over this process's
    own cgroup and each parent up to the hierarchy's root (a parent's limit counts for every cgroup below it), in the
    v1 memory controller (`cgroup_root`/memory) and in v2 (`cgroup_root`, or `cgroup_root`/unified on a hybrid
    machine). Room is limit minus working set: usage less the page cache the kernel can reclaim (inactive_file), as
    the kernel's and docker's working set count it, so a warm page cache is not taken for used memory. None where no
    cgroup has a limit (or none can be read)."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: "0::/path"
            for mount in (cgroup_root, os.path.join(cgroup_root, "unified")):
                rooms.append(_hierarchy_room(mount, path, "memory.max", "memory.current", "inactive_file"))
        elif "memory" in controllers.split(","):  # v1: "4:memory:/path"
            rooms.append(_hierarchy_room(os.path.join(cgroup_root, "memory"), path, "memory.limit_in_bytes",
                                         "memory.usage_in_bytes", "total_inactive_file"))
    rooms = [r for r in rooms if r is not None]
    return min(rooms) if rooms else None


def _hierarchy_room(mount: str, path: str, limit_file: str, usage_file: str, reclaimable: str) -> int | None:
    """The least room over the cgroup at `path` and its parents within one hierarchy mounted at `mount`; None where
    none has a limit. In a container the hierarchy is often mounted at the container's own cgroup, whose path
    /proc/self/cgroup still gives from the host's root: then the path's leading parts are dropped until it exists."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    while parts and not os.path.isdir(os.path.join(mount, *parts)):
        parts = parts[1:]
    rooms = []
    while True:
        directory = os.path.join(mount, *parts)
        room = _room(directory, limit_file, usage_file, reclaimable)
        if room is not None:
            rooms.append(room)
        if not parts:
            break
        parts = parts[:-1]
    return min(rooms) if rooms else None


def _room(directory: str, limit_file: str, usage_file: str, reclaimable: str) -> int | None:
    """limit - (usage - reclaimable page cache) of one cgroup, at least 0; None where it has no limit or its files
    cannot be read. v1's memory.stat also gives hierarchical_memory_limit, the least limit of the cgroup and every
    parent, including parents above a container's mount that cannot be walked."""
    try:
        with open(os.path.join(directory, limit_file)) as f:
            text = f.read().strip()
        limit = None if text == "max" else int(text)
        stat = {}
        try:
            with open(os.path.join(directory, "memory.stat")) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if value.strip().isdigit():
                        stat[name] = int(value)
        except OSError:
            pass
        inherited = stat.get("hierarchical_memory_limit")
        if inherited is not None and (limit is None or inherited < limit):
            limit = inherited
        if limit is None or limit < 0 or limit >= _UNLIMITED:
            return None
        with open(os.path.join(directory, usage_file)) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    working_set = max(usage - stat.get(reclaimable, 0), 0)
    return max(limit - working_set, 0)


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
