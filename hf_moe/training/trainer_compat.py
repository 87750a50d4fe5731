"""Make the plain `transformers.Trainer` resume hf_moe checkpoints, and refuse expert-parallel models.

`Trainer._load_from_checkpoint` loads a sharded checkpoint with `transformers.trainer_utils.load_sharded_checkpoint`,
which compares the index's keys with `model.state_dict()` and calls `model.load_state_dict` per file. For an
hf_moe model the index holds per-expert keys (`...experts.3.down_proj`) and the model fused ones
(`...experts.down_proj`): the tensors load (through `Experts`' load hook) but Trainer would report every expert
tensor as both missing and unexpected. The wrapper below sends hf_moe models to `hf_moe.checkpoint.load_checkpoint`,
which loads the same files and reports keys in on-disk names; every other model goes to the original function.

`Trainer.train` is also wrapped to refuse an expert-parallel model unless the trainer is `hf_moe.MoETrainer`, so
that a plain Trainer never trains for hours and then loses the other ranks' experts at the first checkpoint.
"""

from __future__ import annotations

import functools

import transformers.trainer

from ..checkpoint import load_checkpoint
from ..modeling import MoEForCausalLM


def _unwrap(model):
    while hasattr(model, "module"):  # DDP / DataParallel
        model = model.module
    return model


def _refuse_expert_parallel(train):
    """Trainer.train that stops at once, with the fix, when given an expert-parallel model it cannot checkpoint."""

    @functools.wraps(train)
    def guarded(self, *args, **kwargs):
        from .trainer import MoETrainer

        if getattr(_unwrap(self.model), "expert_parallel_plan", None) is not None and not isinstance(self, MoETrainer):
            raise RuntimeError(
                "This model is expert-parallel: train it with hf_moe.MoETrainer, a drop-in subclass of "
                "transformers.Trainer. The plain Trainer saves checkpoints from rank 0 alone and would lose the "
                "other ranks' experts and optimizer state."
            )
        return train(self, *args, **kwargs)

    guarded._hf_moe = True
    return guarded


def install() -> None:
    """Patch `transformers.trainer.load_sharded_checkpoint` and guard `Trainer.train` (idempotent)."""
    if not getattr(transformers.trainer.Trainer.train, "_hf_moe", False):
        transformers.trainer.Trainer.train = _refuse_expert_parallel(transformers.trainer.Trainer.train)
    original = transformers.trainer.load_sharded_checkpoint
    if getattr(original, "_hf_moe", False):
        return

    @functools.wraps(original)
    def load_sharded_checkpoint(model, folder, strict=True, prefer_safe=True):
        if isinstance(_unwrap(model), MoEForCausalLM):
            return load_checkpoint(_unwrap(model), folder, strict=strict)
        return original(model, folder, strict=strict, prefer_safe=prefer_safe)

    load_sharded_checkpoint._hf_moe = True
    transformers.trainer.load_sharded_checkpoint = load_sharded_checkpoint
