"""Updating the aux_free routers' selection bias after every optimizer step, without the user's help.

The bias must move once per optimizer step, from the loads of all the micro-batches of that step (gradient
accumulation) on all processes. hf_moe registers one global `torch.optim` step post-hook; after a step of an
optimizer that holds a tracked model's router weights, it calls `model.update_router_biases()`. Optimizers that
only step every N micro-batches (Accelerate's under `accumulate`, Trainer's) therefore update once per real step.
"""

from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook

_models: weakref.WeakSet = weakref.WeakSet()
_param_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> ids of its parameters
_handle = None


def track(model) -> None:
    """Update `model`'s aux_free router biases after each step of any optimizer that holds its router weights."""
    global _handle
    from ..layers.router import AuxFreeRouter

    if not any(isinstance(m, AuxFreeRouter) for m in model.modules()):
        return
    _models.add(model)
    if _handle is None:
        _handle = register_optimizer_step_post_hook(_after_step)


def _after_step(optimizer, args, kwargs) -> None:
    from ..layers.router import AuxFreeRouter

    ids = _param_ids.get(optimizer)
    if ids is None or sum(len(g["params"]) for g in optimizer.param_groups) != len(ids):
        ids = _param_ids[optimizer] = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model in list(_models):
        router = next((m for m in model.modules() if isinstance(m, AuxFreeRouter)), None)
        if router is not None and id(router.weight) in ids:
            model.update_router_biases()
