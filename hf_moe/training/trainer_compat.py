"""Make the plain `transformers.Trainer` resume hf_moe checkpoints.

`Trainer._load_from_checkpoint` loads a sharded checkpoint with `transformers.trainer_utils.load_sharded_checkpoint`,
which compares the index's keys with `model.state_dict()` and calls `model.load_state_dict` per file. For an
hf_moe model the index holds per-expert keys (`...experts.3.down_proj`) and the model fused ones
(`...experts.down_proj`): the tensors load (through `Experts`' load hook) but Trainer would report every expert
tensor as both missing and unexpected. The wrapper below sends hf_moe models to `hf_moe.checkpoint.load_checkpoint`,
which loads the same files and reports keys in on-disk names; every other model goes to the original function.
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


def install() -> None:
    """Patch `transformers.trainer.load_sharded_checkpoint` (idempotent)."""
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
