"""Expert parallelism: each rank holds a block of every MoE layer's experts; tokens travel to their experts.

    import hf_moe
    model = hf_moe.MoEForCausalLM.from_pretrained(path, expert_parallel=True)   # reads only this rank's experts
    # or: hf_moe.expert_parallel(model)                                         # shards a loaded model in place
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)    # DDP for the other parameters

Launch with `torchrun` or `accelerate launch` (one machine or many). With more processes than experts can be
spread over, pass `expert_parallel_size`: the processes form world / size replicas of the experts. See
groups.py (placement), dispatch.py (the exchanges), clip.py (global gradient norm).
"""

from __future__ import annotations

import contextlib

from torch import nn

from .clip import clip_grad_norm_
from .groups import ExpertParallelPlan, build_plan

__all__ = ["ExpertParallelPlan", "build_plan", "clip_grad_norm_", "expert_parallel", "local_experts"]

_constructing: list[ExpertParallelPlan] = []


@contextlib.contextmanager
def local_experts(plan: ExpertParallelPlan):
    """Experts modules built inside the block allocate only this rank's experts (used while loading)."""
    _constructing.append(plan)
    try:
        yield
    finally:
        _constructing.pop()


def plan_under_construction() -> ExpertParallelPlan | None:
    return _constructing[-1] if _constructing else None


def expert_parallel(model: nn.Module, process_group=None, expert_parallel_size: int | None = None) -> nn.Module:
    """Shard every MoE layer's experts across the expert-parallel group, in place, and return the model.

    Rank r of a group of P keeps experts [r * E / P, (r + 1) * E / P); the others are freed. Call it before
    `accelerator.prepare` / DDP: it lists the expert parameters in `_ddp_params_and_buffers_to_ignore`, since their
    gradients are reduced by hf_moe (scaled like DDP's, and summed over replicas).

    Raises:
        ValueError: if E is not a multiple of the group size, or the model is already expert-parallel.
    """
    from ..layers import Experts

    plan = build_plan(process_group, expert_parallel_size)
    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        if experts.ep_plan is not None:
            raise ValueError("This model is already expert-parallel.")
        start, end = plan.expert_range(experts.num_experts)
        for name, param in list(experts.named_parameters(recurse=False)):
            local = nn.Parameter(param.detach()[start:end].clone(), requires_grad=param.requires_grad)
            setattr(experts, name, local)
        experts.num_local_experts, experts.expert_offset, experts.ep_plan = end - start, start, plan
    return finish(model, plan)


def finish(model: nn.Module, plan: ExpertParallelPlan) -> nn.Module:
    """Record the plan on the model, mark the expert parameters and keep them out of DDP."""
    from ..layers import Experts
    from ..layers.router import ExpertChoiceRouter

    if any(isinstance(m, ExpertChoiceRouter) for m in model.modules()):
        raise NotImplementedError(
            "Expert-choice routing is not supported with expert parallelism: each expert would need every rank's "
            "tokens to pick from. Use a token-choice router."
        )
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    for module_name, module in model.named_modules():
        if isinstance(module, Experts):
            for name, param in module.named_parameters(recurse=False):
                param._hf_moe_ep_plan = plan  # lets clip_grad_norm_ find them among any list of parameters
                ignored.append(f"{module_name}.{name}")
    model._ddp_params_and_buffers_to_ignore = sorted(set(ignored))
    model.expert_parallel_plan = plan
    return model
