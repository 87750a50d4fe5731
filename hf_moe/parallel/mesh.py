"""The device mesh of expert parallelism, and where this process sits on it.

With W processes and an expert-parallel (EP) size P (W = D * P), the processes form a 2-D `DeviceMesh`
of shape (D, P), dims ("dp", "ep"), rank d * P + p at [d, p]:

    "ep"   each row, P consecutive ranks (one node, when P is the GPUs per node): together they hold every expert
           once, rank p of the row experts [p * E / P, (p + 1) * E / P); tokens travel between them (all_to_all).
    "dp"   each column, the D ranks that hold the same block of experts (expert data parallelism): FSDP2 shards
           that block over them, so every expert lives on exactly one process.

The non-expert parameters are sharded over the same mesh by FSDP2 (hybrid: sharded along "ep", replicated along
"dp"). Every parameter is then a DTensor on this one mesh, which is what `torch.nn.utils.clip_grad_norm_` and
`torch.distributed.checkpoint` need to work on them unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp", "ep")


@dataclass(frozen=True)
class ExpertParallelPlan:
    """Where this process sits on the ("dp", "ep") mesh, and the process groups of each dimension."""

    mesh: DeviceMesh
    ep_group: object
    ep_rank: int
    ep_size: int
    dp_group: object
    dp_rank: int
    dp_size: int
    world_size: int

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[start, end) of the experts of this process's EP rank (the block its "dp" column shares)."""
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={num_experts} does not divide by the expert-parallel size {self.ep_size}: every "
                "rank must hold the same number of experts. Choose an expert_parallel_size that divides it."
            )
        per_rank = num_experts // self.ep_size
        return self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank


def _require_distributed() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "Expert parallelism needs several processes and torch.distributed: launch N of them with "
            "`torchrun --nproc_per_node N script.py` (with or without GPUs; on CPUs they use gloo), or with "
            "`accelerate launch --multi_gpu --num_processes N script.py` (without --multi_gpu, accelerate starts a "
            "single process on a machine without GPUs), and create the process group first (transformers' "
            "TrainingArguments and Accelerator do; or torch.distributed.init_process_group())."
        )


def mesh_device_type() -> str:
    """"cpu" when the default process group is gloo, else the accelerator's device type ("cuda", ...)."""
    if dist.get_backend() == "gloo":
        return "cpu"
    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else "cpu"


@functools.cache
def _mesh(world: object, device_type: str, dp: int, ep: int) -> DeviceMesh:
    # One mesh (and one set of process groups) per layout and process group: every process must create the same
    # groups in the same order, and creating them again for each model would leak them. `world` is the default
    # group object, so a new init_process_group gets new meshes.
    return init_device_mesh(device_type, (dp, ep), mesh_dim_names=MESH_DIMS)


def build_mesh(expert_parallel_size: int | None = None) -> DeviceMesh:
    """The ("dp", "ep") mesh of all processes, with "ep" of size `expert_parallel_size` (default: all processes)."""
    _require_distributed()
    world = dist.get_world_size()
    ep = expert_parallel_size or world
    if ep < 1 or world % ep:
        raise ValueError(
            f"expert_parallel_size={ep} must divide the number of processes ({world}): the processes form "
            f"world / expert_parallel_size replicas of the expert-parallel group."
        )
    return _mesh(dist.group.WORLD, mesh_device_type(), world // ep, ep)


def plan_from_mesh(mesh: DeviceMesh) -> ExpertParallelPlan:
    """The plan of this process on `mesh`, after checking that the mesh is one hf_moe can use."""
    _require_distributed()
    if mesh.mesh_dim_names != MESH_DIMS:
        raise ValueError(
            f"Expert parallelism needs a 2-D DeviceMesh with mesh_dim_names={MESH_DIMS}, got "
            f"{mesh.mesh_dim_names} of shape {tuple(mesh.shape)}. Build it with "
            "init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=('dp', 'ep')), or pass "
            "expert_parallel_size instead of a mesh."
        )
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"The mesh spans {mesh.size()} of the {dist.get_world_size()} processes. It must span all of them: the "
            "other processes would run the non-expert layers with no one to exchange tokens with."
        )
    ep, dp = mesh["ep"], mesh["dp"]
    return ExpertParallelPlan(
        mesh=mesh,
        ep_group=ep.get_group(),
        ep_rank=ep.get_local_rank(),
        ep_size=ep.size(),
        dp_group=dp.get_group(),
        dp_rank=dp.get_local_rank(),
        dp_size=dp.size(),
        world_size=mesh.size(),
    )


def build_plan(process_group=None, expert_parallel_size: int | None = None, mesh: DeviceMesh | None = None):
    """The plan of this process.

    Args:
        process_group: the group of all processes, as the expert-parallel group (kept for older callers).
        expert_parallel_size: processes per expert-parallel group (default: all processes); the processes then form
            world / expert_parallel_size groups, each holding every expert once.
        mesh: a ("dp", "ep") DeviceMesh to use instead (see the module docstring).
    """
    _require_distributed()
    if sum(x is not None for x in (process_group, expert_parallel_size, mesh)) > 1:
        raise ValueError("Pass one of process_group, expert_parallel_size and mesh, not several.")
    if mesh is not None:
        return plan_from_mesh(mesh)
    if process_group is not None:
        size = dist.get_world_size(process_group)
        if size != dist.get_world_size():
            raise ValueError(
                f"process_group has {size} of the {dist.get_world_size()} processes; the experts would then be "
                "replicated across groups hf_moe does not know. Pass expert_parallel_size instead, and hf_moe "
                "builds the expert-parallel and expert-data-parallel groups."
            )
    return plan_from_mesh(build_mesh(expert_parallel_size))
