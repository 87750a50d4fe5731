"""Expert parallelism composed with FSDP2, on one ("dp", "ep") DeviceMesh: every parameter a DTensor.

    import hf_moe
    model = hf_moe.MoEForCausalLM.from_pretrained(path, expert_parallel=True)   # reads only this rank's experts
    model = hf_moe.parallelize(model)            # FSDP2 for the other parameters (or pass a full model: it shards it)
    optimizer = torch.optim.AdamW(model.parameters(), lr=...)
    ...
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)                      # the global norm, torch's own

Launch with `torchrun` or `accelerate launch`. Layout (mesh.py): the experts are DTensors sharded on dim 0 over
"ep" and FSDP2-sharded over "dp" (shard.py); tokens travel over "ep" (dispatch.py); the other parameters are
FSDP2-sharded along "ep" and replicated along "dp" (`parallelize`). Training checkpoints that reshard on load:
`hf_moe.parallel.save_training_state` / `load_training_state` (training_state.py).

`hf_moe.expert_parallel(model)` (and `from_pretrained(expert_parallel=True)`) shards only the experts, for a caller
that handles the rest: DDP (`Accelerator().prepare(model)`, or `DistributedDataParallel`), `fully_shard` by hand
(pass `mesh=hf_moe.parallel.device_mesh(model)` to keep `torch.nn.utils.clip_grad_norm_` on one mesh) or
Accelerate's FSDP2 plugin. Under DDP the experts stay out of DDP's buckets and broadcasts (they are listed in
`_ddp_params_and_buffers_to_ignore`, DDP's convention) and reduce their own gradients as FSDP2 units over "dp", the
processes that hold the same experts (expert data parallelism): dense gradients averaged by DDP, expert gradients by
FSDP2, both the gradient of the mean loss. `accelerator.save_state` / `load_state` need
`hf_moe.parallel.register_for_checkpointing(accelerator, model, optimizer)` (accelerate_state.py).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..compat import ddp_ignore_parameters, declare_sharded_at_load
from ..layers import Experts
from ..layers.router import ExpertChoiceRouter
from .accelerate_state import register_for_checkpointing
from .mesh import ExpertParallelPlan, build_mesh, build_plan
from .shard import shard_experts
from .training_state import load_training_state, save_training_state

__all__ = [
    "ExpertParallelPlan", "build_mesh", "build_plan", "device_mesh", "expert_parallel", "load_training_state",
    "parallelize", "register_for_checkpointing", "save_training_state",
]


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def device_mesh(model: nn.Module):
    """The ("dp", "ep") DeviceMesh an expert-parallel model is sharded on (None if it is not)."""
    plan = getattr(model, "expert_parallel_plan", None)
    return None if plan is None else plan.mesh


def expert_parallel(
    model: nn.Module, process_group=None, expert_parallel_size: int | None = None, mesh=None
) -> nn.Module:
    """Shard every MoE layer's experts over the ("dp", "ep") mesh, in place, and return the model.

    The expert parameters become DTensors: process (d, p) stores its share of block p of the experts (see
    shard.py), and each `Experts` module is an FSDP2 unit that reduces its own gradients. The other parameters are
    left as they are, for DDP (the experts are listed as parameters DDP ignores), `fully_shard` by hand or
    Accelerate's FSDP2 plugin; `hf_moe.parallelize` shards both.

    Raises:
        ValueError: if E is not a multiple of the expert-parallel size, or the model is already expert-parallel.
    """
    if getattr(model, "expert_parallel_plan", None) is not None:
        raise ValueError("This model is already expert-parallel.")
    _refuse_expert_choice(model)
    plan = build_plan(process_group, expert_parallel_size, mesh)
    for experts in _experts_modules(model):
        shard_experts(experts, plan, holds_block=False)
    return _mark(model, plan)


def finish(model: nn.Module, plan: ExpertParallelPlan) -> nn.Module:
    """Shard a model whose experts were built holding only this process's block (`from_pretrained`)."""
    _refuse_expert_choice(model)
    for experts in _experts_modules(model):
        shard_experts(experts, plan, holds_block=True)
    return _mark(model, plan)


def _mark(model: nn.Module, plan: ExpertParallelPlan) -> nn.Module:
    """Record the plan, and keep the experts out of DDP: each process holds other experts (DDP would broadcast rank
    0's over them, and average gradients of different experts), and their FSDP2 units reduce their gradients."""
    model.expert_parallel_plan = plan
    experts = set(_experts_modules(model))
    ddp_ignore_parameters(model, [
        f"{name}.{param}" for name, module in model.named_modules() if module in experts
        for param, _ in module.named_parameters(recurse=False)
    ])
    for module in experts:
        # Under DDP each Experts unit is an FSDP2 root, which FSDP2 keeps gathered over "dp" from forward to backward:
        # reshard it after forward, as it does under `parallelize` (a child unit), so the experts keep 1 / world of
        # the memory during a step.
        module.set_reshard_after_forward(True, recurse=False)
    return model


def _refuse_expert_choice(model: nn.Module) -> None:
    if any(isinstance(m, ExpertChoiceRouter) for m in model.modules()):
        raise NotImplementedError(
            "Expert-choice routing is not supported with expert parallelism: each expert would need every rank's "
            "tokens to pick from. Use a token-choice router."
        )


def parallelize(model: nn.Module, mesh=None, expert_parallel_size: int | None = None, fsdp: bool = True) -> nn.Module:
    """Expert parallelism x FSDP2 on one ("dp", "ep") mesh, in place; returns the model.

    Args:
        mesh: a DeviceMesh with mesh_dim_names ("dp", "ep"); default: all processes, "ep" of size
            `expert_parallel_size` (default: all processes).
        fsdp: also shard the other parameters with FSDP2, one unit per decoder layer plus the root: sharded along
            "ep", replicated along "dp" (HSDP), so that every parameter is a DTensor on the same mesh. With False
            only the experts are sharded (`hf_moe.expert_parallel`).

    Every process must hold the same weights before the call (load them, or seed identically), as for FSDP2.
    A model loaded with `from_pretrained(expert_parallel=True)` keeps its experts and mesh.
    """
    plan = getattr(model, "expert_parallel_plan", None)
    if plan is None:
        expert_parallel(model, expert_parallel_size=expert_parallel_size, mesh=mesh)
        plan = model.expert_parallel_plan
    elif (mesh is not None and mesh != plan.mesh) or (expert_parallel_size not in (None, plan.ep_size)):
        raise ValueError(
            f"The model is already expert-parallel over a ({plan.dp_size}, {plan.ep_size}) ('dp', 'ep') mesh; "
            "call parallelize without mesh / expert_parallel_size, or on a model that is not sharded yet."
        )
    if not fsdp:
        return model
    experts = set(_experts_modules(model))
    sharded = [name for name, m in model.named_modules() if isinstance(m, FSDPModule) and m not in experts]
    if sharded:
        raise ValueError(
            f"FSDP is already applied to {sharded[:3]}: parallelize shards a model whose non-expert parameters are "
            "plain (use fsdp=False to shard only the experts, and apply fully_shard yourself)."
        )
    for layer in model.get_submodule(model.config.decoder_layers_path):
        fully_shard(layer, mesh=plan.mesh)  # 2-D mesh: HSDP, replicated along "dp", sharded along "ep"
    fully_shard(model, mesh=plan.mesh)
    declare_sharded_at_load(model)
    return model
