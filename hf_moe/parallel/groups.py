"""Process groups for expert parallelism.

With W processes and an expert-parallel (EP) size P (W = P * D):

    EP groups              consecutive ranks [0..P-1], [P..2P-1], ...: together they hold every expert once;
                           tokens travel between the ranks of one EP group (all_to_all).
    expert-data-parallel   ranks holding the same experts, {r, r + P, r + 2P, ...} (D of them): their expert
    (EDP) groups           gradients are summed (all_reduce), as DDP does for the other parameters.

Rank r of an EP group holds experts [r * E / P, (r + 1) * E / P) of every MoE layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ExpertParallelPlan:
    """Where this process sits. `grad_scale` = 1 / world size, so expert gradients average like DDP's."""

    ep_group: object
    ep_rank: int
    ep_size: int
    edp_group: object | None
    edp_rank: int
    edp_size: int
    world_size: int

    @property
    def grad_scale(self) -> float:
        return 1.0 / self.world_size

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[start, end) of the experts this process holds."""
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={num_experts} does not divide by the expert-parallel size {self.ep_size}: every "
                "rank must hold the same number of experts. Choose an expert_parallel_size that divides it."
            )
        per_rank = num_experts // self.ep_size
        return self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank


@functools.cache
def _groups(world_size: int, ep_size: int) -> tuple[list, list]:
    """All EP groups and all EDP groups (every process must create every group, in the same order)."""
    ep = [dist.new_group(list(range(start, start + ep_size))) for start in range(0, world_size, ep_size)]
    edp = [dist.new_group(list(range(r, world_size, ep_size))) for r in range(ep_size)] if world_size > ep_size else []
    return ep, edp


def build_plan(process_group=None, expert_parallel_size: int | None = None) -> ExpertParallelPlan:
    """The plan of this process.

    Args:
        process_group: a group of all the processes to use as the EP group. Default: the world.
        expert_parallel_size: with the default group, split the world into EP groups of this size (the default is
            the whole world); the experts are then replicated world_size / expert_parallel_size times.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "Expert parallelism needs several processes and torch.distributed: launch with "
            "`torchrun --nproc_per_node N ...` or `accelerate launch --num_processes N ...` (on a machine without "
            "GPUs, accelerate starts several processes only with --multi_gpu; they then run on the CPU with gloo), "
            "and create the process group first (transformers' TrainingArguments and Accelerator do; or "
            "torch.distributed.init_process_group())."
        )
    if process_group is not None:
        if expert_parallel_size is not None:
            raise ValueError("Pass either a process_group or an expert_parallel_size, not both.")
        size = dist.get_world_size(process_group)
        if size != dist.get_world_size():
            raise ValueError(
                f"process_group has {size} of the {dist.get_world_size()} processes; the experts would then be "
                "replicated across groups hf_moe does not know. Pass expert_parallel_size instead, and hf_moe "
                "builds the expert-parallel and expert-data-parallel groups."
            )
        return ExpertParallelPlan(process_group, dist.get_rank(process_group), size, None, 0, 1, size)
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_size = expert_parallel_size or world
    if ep_size < 1 or world % ep_size:
        raise ValueError(
            f"expert_parallel_size={ep_size} must divide the number of processes ({world}): the processes form "
            f"world / expert_parallel_size replicas of the experts."
        )
    ep_groups, edp_groups = _groups(world, ep_size)
    edp_size = world // ep_size
    return ExpertParallelPlan(
        ep_group=ep_groups[rank // ep_size],
        ep_rank=rank % ep_size,
        ep_size=ep_size,
        edp_group=edp_groups[rank % ep_size] if edp_size > 1 else None,
        edp_rank=rank // ep_size,
        edp_size=edp_size,
        world_size=world,
    )
