"""What a conversion will need, estimated before any work from the dense model and its first MLP: the MoE checkpoint's
bytes and files on disk, and the host memory an in-memory conversion adds. What cannot fit (the free space and free
inodes of OUT's filesystem, the memory available) is refused with the numbers, before a byte is written: 100000
experts of a tiny model would otherwise stream tens of GB in a file per expert, and `--in-memory` grow until the
machine swaps. `HF_MOE_SKIP_SIZE_CHECK=1` goes ahead regardless (a filesystem that compresses, a quota the numbers do not
show).

The estimate is the tensors' bytes (the expert sizes are `api._expert_sizes`', so upcycling, splitting and shared
experts are counted as they are built); headers, the index and the config add little more.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..memory import SKIP_VARIABLE, available_memory, format_bytes, size_check_skipped

_SMALL_FILES = 6  # config, generation config, index, model card, a tokenizer file or two (one to spare)


@dataclass(frozen=True)
class ConversionSize:
    """The MoE model a conversion makes: `output_bytes` of tensors in `files` files; `expert_bytes` of them in the
    `num_experts` routed experts of each of `num_layers` MoE layers (`added_bytes`: what the MoE model holds beyond
    the dense one)."""

    output_bytes: int
    added_bytes: int
    files: int
    num_experts: int
    num_layers: int
    expert_bytes: int

    def describe(self) -> str:
        return (f"{self.num_experts} experts x {self.num_layers} MoE layer(s), {format_bytes(self.expert_bytes)} "
                "each")


def estimate_conversion(dense_bytes: int, mlp, sizes: dict, num_experts: int, num_layers: int, num_shared: int,
                        itemsize: int, max_shard_bytes: int) -> ConversionSize:
    """The MoE model made from a dense one of `dense_bytes` (its parameters' bytes) whose MLPs look like `mlp` (a
    `DenseMLP`: H hidden, I intermediate, GLU or not, biases or not), `num_layers` of them converted into `num_experts`
    experts (plus `num_shared` shared ones) of the sizes `sizes` (`api._expert_sizes`: moe_intermediate_size,
    shared_expert_intermediate_size), in a dtype of `itemsize` bytes."""
    hidden, glu, bias = mlp.hidden_size, mlp.glu, mlp.has_bias

    def mlp_numel(inner: int) -> int:
        return (3 if glu else 2) * hidden * inner + ((2 if glu else 1) * inner + hidden if bias else 0)

    expert = mlp_numel(sizes["moe_intermediate_size"]) * itemsize
    shared = mlp_numel(sizes["shared_expert_intermediate_size"] or 0) * itemsize * num_shared
    router = num_experts * hidden * itemsize
    dense_mlp = sum(t.numel() for t in _tensors(mlp)) * itemsize
    per_layer = num_experts * expert + shared + router
    non_expert = max(dense_bytes - num_layers * dense_mlp, 0)
    per_file = max(1, math.ceil(expert * num_layers / max(max_shard_bytes, 1)))
    files = num_experts * per_file + max(1, math.ceil(non_expert / max(max_shard_bytes, 1))) + _SMALL_FILES
    return ConversionSize(non_expert + num_layers * per_layer, num_layers * (per_layer - dense_mlp), files,
                          num_experts, num_layers, expert)


def _tensors(mlp):
    return [t for t in (mlp.gate, mlp.up, mlp.down, mlp.gate_bias, mlp.up_bias, mlp.down_bias) if t is not None]


def check_disk(out, size: ConversionSize | int, files: int | None = None) -> None:
    """Refuse (`ValueError`, with the numbers) an output of `size` (bytes, or a `ConversionSize`) and `files` files
    that the filesystem OUT will be on cannot hold: the whole new checkpoint is written before the old one (if any) is
    removed, so it must fit in the free space."""
    if size_check_skipped():
        return
    if isinstance(size, ConversionSize):
        size, files, what = size.output_bytes, size.files, f" ({size.describe()})"
    else:
        what = ""
    where = _existing_ancestor(Path(os.path.abspath(out)))
    free, free_files = free_space(where)
    if size > free or (files is not None and free_files is not None and files > free_files):
        have = f"{format_bytes(free)} free" if size > free else f"room for {free_files:,} more files (inodes)"
        count = f" in {files:,} files" if files else ""
        raise ValueError(
            f"The MoE checkpoint would take about {format_bytes(size)}{count}{what}, but {where} has {have}. Choose an "
            "OUT on a larger filesystem, fewer experts, or fewer MoE layers (--layers, --every); or, if you know it "
            f"fits (a compressing filesystem), set {SKIP_VARIABLE}=1."
        )


def check_memory(size: ConversionSize, streaming_hint: str) -> None:
    """Refuse (`ValueError`, with the numbers) an in-memory conversion whose MoE model would need more memory than is
    available."""
    if size_check_skipped():
        return
    available = available_memory()
    if available is not None and size.added_bytes > available:
        raise ValueError(
            f"Converting in memory would hold about {format_bytes(size.added_bytes)} more than the dense model "
            f"({size.describe()}), but {format_bytes(available)} of memory is available. {streaming_hint} Or "
            f"choose fewer experts or MoE layers; or, if you know it fits, set {SKIP_VARIABLE}=1."
        )


def free_space(where: Path) -> tuple[int, int | None]:
    """(bytes, files) that the filesystem holding `where` can still take (files: free inodes; None where the
    filesystem has no inode limit, as btrfs)."""
    stats = os.statvfs(where) if hasattr(os, "statvfs") else None
    return shutil.disk_usage(where).free, stats.f_favail if stats is not None and stats.f_files else None


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
