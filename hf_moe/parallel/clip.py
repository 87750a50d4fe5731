"""Gradient clipping with the global norm when experts are sharded across ranks.

Each rank holds different experts, so the norm of its local gradients differs from rank to rank; clipping with it
would scale the replicated (non-expert) parameters differently on each rank, and they would drift apart. The
global norm counts every parameter once:

    norm^2 = sum over non-expert parameters (identical on every rank)
           + all_reduce_sum over the expert-parallel group of the local expert parameters

(replicas of the same experts, in other EP groups, hold identical gradients and are counted once). Every rank
then applies the same coefficient. `install()` routes `accelerate.Accelerator.clip_grad_norm_` (which
transformers.Trainer uses) here whenever the parameters include sharded experts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.distributed as dist


def _plan_of(params: list[torch.Tensor]):
    return next((p._hf_moe_ep_plan for p in params if getattr(p, "_hf_moe_ep_plan", None) is not None), None)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_`, with the global norm over expert-parallel ranks. Returns the total norm.

    Only the 2-norm is supported when experts are sharded.
    """
    params = [p for p in parameters if p.grad is not None]
    plan = _plan_of(params)
    if plan is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    if float(norm_type) != 2.0:
        raise ValueError(f"With expert parallelism only the 2-norm is supported for clipping, got {norm_type}.")
    if not params:
        return torch.zeros(())
    device = params[0].grad.device
    expert = torch.zeros((), dtype=torch.float32, device=device)
    other = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        sq = p.grad.detach().float().pow(2).sum()
        if getattr(p, "_hf_moe_ep_plan", None) is not None:
            expert += sq
        else:
            other += sq
    dist.all_reduce(expert, group=plan.ep_group)
    total = (expert + other).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return total


def install() -> None:
    """Route `Accelerator.clip_grad_norm_` here when its parameters include sharded experts (idempotent)."""
    from accelerate import Accelerator

    original = Accelerator.clip_grad_norm_
    if getattr(original, "_hf_moe", False):
        return

    @functools.wraps(original)
    def accelerator_clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        params = list(parameters)
        if _plan_of(params) is None:
            return original(self, params, max_norm, norm_type=norm_type)
        self.unscale_gradients()
        return clip_grad_norm_(params, max_norm, norm_type=norm_type)

    accelerator_clip_grad_norm_._hf_moe = True
    Accelerator.clip_grad_norm_ = accelerator_clip_grad_norm_
