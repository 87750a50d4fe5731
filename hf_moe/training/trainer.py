"""`MoETrainer`: `transformers.Trainer` whose checkpoints resume on any number of processes.

For every hf_moe model, sharded or not, each checkpoint-N/ holds, beside the weights in the per-expert
safetensors layout, `training_state/`: model, optimizer, scheduler, the RNG of every process and the position in
the data, written with `torch.distributed.checkpoint` by `hf_moe.parallel.save_training_state`. Resuming loads it
resharded to the current layout: a run checkpointed on 4 processes resumes on 2, or on 1.

A model sharded by `hf_moe.parallelize` (expert parallelism x FSDP2, every parameter a DTensor) owns its gradient
reduction: MoETrainer tells Trainer so (as for a model `from_pretrained(distributed_config=...)` sharded), and
Trainer then neither wraps it in DDP nor shards it again, clips with `torch.nn.utils.clip_grad_norm_` on its one
mesh, and calls `save_pretrained` on every process (each writes its own experts). The plain Trainer runs such a
model too, with checkpoints of the weights only (`save_only_model=True`); it refuses to checkpoint its optimizer.

The aux_free routers' selection bias moves after each step of the optimizer MoETrainer trains with
(`attach_aux_free`, done when training begins, whoever made the optimizer).
"""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from transformers import Trainer, TrainerCallback

from ..checkpoint import recover_interrupted_commit
from ..compat import TRANSFORMERS_VERSION, trainer_supports_sharded_models
from ..parallel.training_state import (
    TrainingStateError,
    load_training_state,
    read_training_state_meta,
    save_training_state,
)
from .aux_free import attach_aux_free

TRAINING_STATE_DIR = "training_state"


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _is_sharded_by_hf_moe(model) -> bool:
    return bool(getattr(model, "_is_distributed_loading_by_transformers", False)) and (
        getattr(model, "expert_parallel_plan", None) is not None
    )


@contextlib.contextmanager
def _trainer_checkpoints_optimizer(model):
    """While Trainer.__init__ runs: Trainer refuses to checkpoint the optimizer of a model sharded at load time
    (it would save rank 0's shards only). MoETrainer checkpoints it with DCP, so it hides the mark from that check
    and sets `is_distributed_loading_by_transformers` itself after __init__."""
    marked = _is_sharded_by_hf_moe(model)
    if marked:
        model._is_distributed_loading_by_transformers = False
    try:
        yield marked
    finally:
        if marked:
            model._is_distributed_loading_by_transformers = True


class _AttachAuxFree(TrainerCallback):
    """Attaches the optimizer Trainer trains with (made by then, or passed in) to the model's aux_free routers."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is not None and optimizer is not None:
            attach_aux_free(model, optimizer)


class MoETrainer(Trainer):
    """A `transformers.Trainer` with resharding training checkpoints and hf_moe's sharding (see the module doc)."""

    def __init__(self, model=None, args=None, *more, **kwargs):
        # A parallelized model: its experts expert-parallel and the model itself an FSDP2 unit. (transformers < 5.23
        # has no attribute to mark it with: `_is_sharded_by_hf_moe` cannot see it there.)
        parallelized = getattr(model, "expert_parallel_plan", None) is not None and isinstance(model, FSDPModule)
        if parallelized and not trainer_supports_sharded_models():
            raise RuntimeError(
                f"transformers {TRANSFORMERS_VERSION}'s Trainer would wrap this model, sharded by hf_moe.parallelize, "
                "in DDP, which cannot hold DTensor parameters. Upgrade transformers (5.23 lets a model own its "
                "sharding), or shard only the experts (hf_moe.expert_parallel) and launch with Accelerate's FSDP2 "
                "plugin."
            )
        with _trainer_checkpoints_optimizer(model) as sharded:
            super().__init__(model, args, *more, **kwargs)
        self.add_callback(_AttachAuxFree)
        # transformers < 5.23's Trainer has no such attribute (and refuses sharded models above).
        self.is_distributed_loading_by_transformers = sharded or getattr(
            self, "is_distributed_loading_by_transformers", False
        )
        plan = getattr(_unwrap(self.model), "expert_parallel_plan", None)
        if plan is not None and self.args.world_size != dist.get_world_size():
            raise ValueError(
                f"The model is expert-parallel over {dist.get_world_size()} processes, but TrainingArguments "
                f"sees world_size={self.args.world_size}: every process would train on the same batches and the "
                "experts' gradients would not match the data. On a machine without GPUs pass "
                "TrainingArguments(use_cpu=True) (transformers runs several CPU processes only then); otherwise "
                "launch with torchrun / accelerate launch so that TrainingArguments sees every process."
            )
        if plan is not None and not sharded and not self.is_fsdp_enabled:
            raise ValueError(
                "The experts are sharded (hf_moe.expert_parallel) but the other parameters are not: Trainer would "
                "wrap the model in DDP and save it from rank 0 alone, which holds only its own experts. Call "
                "hf_moe.parallelize(model) to shard them with FSDP2, or launch with "
                "Accelerate's FSDP2 plugin (accelerate launch --use_fsdp --fsdp_version 2 ...)."
            )

    # ----------------------------------------------------------------------------------------------------------
    # Checkpoints: a DCP training state beside Trainer's files
    # ----------------------------------------------------------------------------------------------------------
    def _global_batch_size(self) -> int:
        a = self.args
        return a.per_device_train_batch_size * a.world_size * a.gradient_accumulation_steps

    def _torch_optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)  # under Accelerate's AcceleratedOptimizer

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.is_deepspeed_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        step, batch = self.state.global_step, self._global_batch_size()
        save_training_state(
            os.path.join(output_dir, TRAINING_STATE_DIR),
            _unwrap(self.model),
            self._torch_optimizer(),
            scheduler=self.lr_scheduler,
            data_position={"global_step": step, "global_batch_size": batch, "samples_seen": step * batch},
        )

    def _training_state(self, checkpoint: str | None) -> str | None:
        if checkpoint is None or self.is_deepspeed_enabled:
            return None
        path = os.path.join(checkpoint, TRAINING_STATE_DIR)
        recover_interrupted_commit(path)  # (a state a killed save left hidden is put back)
        return path if os.path.isdir(path) else None

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self._training_state(resume_from_checkpoint) is not None:
            return  # the weights come with the optimizer, resharded (`_load_optimizer_and_scheduler`)
        if _is_sharded_by_hf_moe(_unwrap(self.model)):
            raise TrainingStateError(
                f"{resume_from_checkpoint} has no {TRAINING_STATE_DIR}/ (it was not written by MoETrainer): a model "
                "sharded by hf_moe.parallelize resumes from MoETrainer checkpoints only. To start from its weights, "
                "load them with MoEForCausalLM.from_pretrained(path, expert_parallel=True) and train without "
                "resume_from_checkpoint."
            )
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        path = self._training_state(checkpoint)
        if path is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        position = read_training_state_meta(path)["data_position"]
        saved_batch, batch = position.get("global_batch_size"), self._global_batch_size()
        if saved_batch != batch:
            raise TrainingStateError(
                f"{checkpoint} was trained with a global batch of {saved_batch} samples per step; this run's is "
                f"{batch} (per_device_train_batch_size={self.args.per_device_train_batch_size} x "
                f"{self.args.world_size} process(es) x gradient_accumulation_steps="
                f"{self.args.gradient_accumulation_steps}). Resuming skips global_step batches, so it would start "
                f"at another place in the data: choose the batch size and accumulation steps so that their product "
                f"with the number of processes is {saved_batch}."
            )
        if position.get("global_step") != self.state.global_step:
            raise TrainingStateError(
                f"{path} is at step {position.get('global_step')}, but {checkpoint}/trainer_state.json at step "
                f"{self.state.global_step}: the checkpoint directory mixes two saves. Resume from a complete one."
            )
        load_training_state(path, _unwrap(self.model), self._torch_optimizer(), scheduler=self.lr_scheduler)

    def _defer_fsdp_gradient_reduction(self):
        """Gradient accumulation for a model sharded by hf_moe.parallelize: FSDP2 reduces only on the last
        micro-batch (Trainer's version reads a transformers DistributedConfig that hf_moe models do not have)."""
        model = _unwrap(self.model)
        if not _is_sharded_by_hf_moe(model):
            return super()._defer_fsdp_gradient_reduction()
        return _no_gradient_sync(model)


@contextlib.contextmanager
def _no_gradient_sync(model):
    model.set_requires_gradient_sync(False)  # recurses into every FSDP2 unit, the experts' included
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


__all__ = ["TRAINING_STATE_DIR", "MoETrainer"]
