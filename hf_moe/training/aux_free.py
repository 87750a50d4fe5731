"""Moving the aux_free routers' selection bias after each step of the optimizer that trains the model.

The bias must move once per optimizer step, from the loads of all the micro-batches of that step (gradient
accumulation) on all processes. `attach_aux_free(model, optimizer)` registers a step post-hook on that optimizer
alone (`torch.optim.Optimizer.register_step_post_hook`); after each of its steps, the model's aux_free routers move
their bias. Optimizers that only step every N micro-batches (Accelerate's under `accumulate`, Trainer's) therefore
update once per real step, and no other optimizer in the process (another model's, a probe's) touches the bias.

`MoETrainer` attaches the optimizer it trains with; a plain loop (Accelerate, torch) or another Trainer (TRL's) calls
`hf_moe.attach_aux_free(model, optimizer)` once, before training.
"""

from __future__ import annotations

import weakref

import torch

from ..layers.router import AuxFreeRouter

__all__ = ["attach_aux_free"]

# optimizer -> the hook that moves the bias of the routers attached to it (one hook per optimizer, however many calls)
_updates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _BiasUpdate:
    """An optimizer's step post-hook: moves the selection bias of the routers attached to it."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = weakref.ref(optimizer)
        self.routers: list[weakref.ref] = []  # weak: the optimizer does not keep a dropped model's routers alive
        self._handle = optimizer.register_step_post_hook(self)

    def __call__(self, optimizer, args, kwargs) -> None:
        for router in self._live():
            router.update_bias()

    def _live(self) -> list[AuxFreeRouter]:
        return [r for r in (ref() for ref in self.routers) if r is not None]

    def remove(self) -> None:
        """Stop moving the bias after this optimizer's steps."""
        self._handle.remove()
        for router in self._live():
            router.bias_updates_attached = False
        optimizer = self.optimizer()
        if optimizer is not None and _updates.get(optimizer) is self:
            del _updates[optimizer]


def _torch_optimizer(optimizer):
    """The torch optimizer that steps inside wrappers (Accelerate's AcceleratedOptimizer, DeepSpeed's): it steps only
    when the wrapper really steps (after the last micro-batch of an accumulation)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def attach_aux_free(model: torch.nn.Module, optimizer) -> _BiasUpdate | None:
    """Move the selection bias of `model`'s aux_free routers after each step of `optimizer`, and only of it.

    `model` may be wrapped (DDP, PEFT: its modules are searched); `optimizer` a torch optimizer or a wrapper around
    one (Accelerate's `AcceleratedOptimizer`). Calling it again with the same pair changes nothing. `MoETrainer` calls
    it for its own optimizer. Returns a handle whose `.remove()` stops the updates after this optimizer's steps (for
    every model attached to it), or None when `model` has no aux_free router.

    Raises:
        TypeError: if `optimizer` is not a `torch.optim.Optimizer` (nor wraps one): then call
            `model.update_router_biases()` after each of its steps yourself.
    """
    routers = [m for m in model.modules() if isinstance(m, AuxFreeRouter)]
    if not routers:
        return None
    inner = _torch_optimizer(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"attach_aux_free needs a torch.optim.Optimizer (or a wrapper with one in `.optimizer`), got "
            f"{type(optimizer).__name__}. With another optimizer, call model.update_router_biases() after each of its "
            "steps yourself."
        )
    update = _updates.get(inner)
    if update is None:
        update = _updates[inner] = _BiasUpdate(inner)
    attached = {id(router) for router in update._live()}
    for router in routers:
        router.bias_updates_attached = True
        if id(router) not in attached:
            update.routers.append(weakref.ref(router))
    return update
