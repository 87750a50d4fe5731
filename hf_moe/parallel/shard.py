"""Expert weights as DTensors: sharded on dim 0 over "ep", and FSDP2-sharded over "dp".

Each `Experts` module becomes its own FSDP2 unit, on the ("dp", "ep") mesh (see mesh.py):

    parameter    DTensor [E, ...] on the "ep" sub-mesh, Shard(0), before FSDP: block p of E / P experts on "ep"
    stored       `fully_shard` over the "dp" sub-mesh shards each block: on dim 0 (whole experts per process) when
                 the block's experts divide evenly over "dp", else on dim 1 (a slice of every expert of the block;
                 as torchtitan does), so that memory falls as 1 / world size even with fewer experts per block than
                 "dp" processes. FSDP2 joins the two sub-meshes: the stored parameter is a DTensor on the whole
                 ("dp", "ep") mesh, the mesh of every other parameter, placed (Shard or _StridedShard, Shard(0)).
                 This is FSDP2's composition with tensor parallelism, in torch 2.11 and newer (torch 2.13's
                 `fully_shard(..., dp_mesh_dims=...)` on the whole mesh would do the same, and only there).
    forward      FSDP2 all-gathers the block over "dp"; the dispatch (dispatch.py) computes with `param.to_local()`
    gradient     the local block's gradient sums the contributions of the P ranks of the row (the all_to_all's
                 backward); FSDP2 reduce-scatters it over "dp" and divides by the world size, so it is the gradient
                 of the mean loss over all processes, as for every other parameter

Because the experts are their own FSDP units, any later `fully_shard` of a parent (by hand, or by Accelerate's
FSDP2 plugin) leaves them alone: FSDP2 does not recurse into a module that already has FSDP applied.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..layers import Experts
from .dispatch import ExpertParallelExperts
from .mesh import ExpertParallelPlan


def _device(plan: ExpertParallelPlan) -> torch.device:
    if plan.mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(plan.mesh.device_type, torch.accelerator.current_device_index())


def shard_experts(experts: nn.Module, plan: ExpertParallelPlan, *, holds_block: bool) -> None:
    """Make `experts`' parameters DTensors of this process's block and the module an FSDP2 unit over "dp".

    Args:
        holds_block: the parameters already hold only this process's block of experts [E / P, ...] (loaded with
            `from_pretrained(expert_parallel=True)`); otherwise they hold all E experts and the others are freed.
    """
    if isinstance(experts, FSDPModule):
        raise ValueError(
            f"{type(experts).__name__} already has FSDP applied: call hf_moe.expert_parallel / hf_moe.parallelize "
            "before fully_shard, so the experts are sharded over the expert-parallel mesh first."
        )
    if type(experts) is not Experts:
        raise TypeError(f"hf_moe shards hf_moe's own Experts modules, not {type(experts).__name__}.")
    start, end = plan.expert_range(experts.num_experts)
    device = _device(plan)
    for name, param in list(experts.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            raise ValueError(f"{name} of {type(experts).__name__} is already a DTensor; shard a plain model.")
        block = param.detach() if holds_block else param.detach()[start:end].clone()
        if block.shape[0] != end - start:
            raise ValueError(
                f"{name} holds {block.shape[0]} experts, but this process's block is experts [{start}, {end})."
            )
        local = DTensor.from_local(block.to(device), plan.mesh["ep"], (Shard(0),), run_check=False)
        setattr(experts, name, nn.Parameter(local, requires_grad=param.requires_grad))
    experts.num_local_experts, experts.expert_offset, experts.ep_plan = end - start, start, plan
    experts.__class__ = ExpertParallelExperts  # its forward exchanges tokens over "ep" (dispatch.py)
    fully_shard(
        experts, mesh=plan.mesh["dp"],
        shard_placement_fn=lambda param: Shard(expert_shard_dim(end - start, plan.dp_size, param.shape)),
    )
    experts.set_gradient_divide_factor(plan.world_size)  # the mean over all processes, not over "dp" only
    if plan.mesh.device_type == "cpu" and plan.dp_size > 1:
        # gloo has no PREMUL_SUM: sum, then divide. Not with a "dp" of one process: FSDP2 (torch 2.11 to 2.13) then
        # copies the gradient divided by the factor and divides it by the factor again.
        experts.set_force_sum_reduction_for_comms(True)


def expert_shard_dim(block: int, dp: int, shape) -> int:
    """The dim FSDP2 shards an expert parameter [block, d1, ...] on over "dp": 0 if the block's experts divide
    evenly, else 1 if d1 does (FSDP2 needs even shards off dim 0), else 0 (uneven chunks)."""
    if block % dp == 0 or len(shape) < 2 or shape[1] % dp:
        return 0
    return 1
