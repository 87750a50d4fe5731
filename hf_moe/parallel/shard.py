"""Expert weights as DTensors: sharded on dim 0 over "ep", and FSDP2-sharded over "dp".

Each `Experts` module becomes its own FSDP2 unit, on the ("dp", "ep") mesh (see mesh.py):

    parameter    DTensor [E, ...], placements (Replicate(), Shard(0)) before FSDP: block p of E / P experts on "ep"
    stored       FSDP2 shards each block on dim 0 over "dp" (torch.chunk's chunks: whole experts, some ranks may
                 hold none): every expert is stored, whole, on exactly one process
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
from torch.distributed.fsdp import DataParallelMeshDims, FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

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
        local = DTensor.from_local(block.to(device), plan.mesh, (Replicate(), Shard(0)), run_check=False)
        setattr(experts, name, nn.Parameter(local, requires_grad=param.requires_grad))
    experts.num_local_experts, experts.expert_offset, experts.ep_plan = end - start, start, plan
    fully_shard(experts, mesh=plan.mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    experts.set_gradient_divide_factor(plan.world_size)  # the mean over all processes, not over "dp" only
    if plan.mesh.device_type == "cpu" and plan.dp_size > 1:
        # gloo has no PREMUL_SUM: sum, then divide. Not with a "dp" of one process: FSDP2 (torch 2.13) then copies
        # the gradient divided by the factor and divides it by the factor again.
        experts.set_force_sum_reduction_for_comms(True)


def whole_local_experts(experts: nn.Module, param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(tensor [n, ...], id of its first expert): the experts of `param` (a parameter of `experts`, or its
    state-dict entry) that this process stores whole.

    Plain parameters: all of them (or the expert-parallel block, before sharding). DTensors (sharded): FSDP2's
    dim-0 chunk of this process's block, ceil(block / dp) experts or fewer (possibly none). No communication.
    """
    if not isinstance(param, DTensor):
        return param.detach(), (experts.expert_offset if param.shape[0] == experts.num_local_experts else 0)
    plan = experts.ep_plan
    local = param.to_local().detach()
    per_rank = -(-experts.num_local_experts // plan.dp_size)  # FSDP2 shards dim 0 in torch.chunk's chunks
    first = experts.expert_offset + plan.dp_rank * per_rank
    return local, first
