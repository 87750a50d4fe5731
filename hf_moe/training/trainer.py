"""`MoETrainer`: `transformers.Trainer` for expert-parallel training.

Without expert parallelism it is the plain Trainer (which already trains, checkpoints and resumes hf_moe models).
With it, transformers.Trainer saves checkpoints from rank 0 alone and would lose the experts and the optimizer
state of the other ranks; `MoETrainer`:

  * saves the model from every rank (each rank writes its own experts' files; the layout is the single-process
    one, loadable with any number of ranks);
  * saves and restores one optimizer-state file per rank (`optimizer-rank00001-of-00004.pt`): resuming needs the
    same number of processes and expert-parallel size;
  * resumes the model weights with each rank reading only its own experts.

Gradient clipping uses the global norm over ranks (hf_moe.parallel.clip, through Accelerate) for both trainers;
a plain Trainer trains them but does not save the other ranks' experts (see issue 11 for the refusal).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import Trainer

from ..compat import trainer_file_names

SCHEDULER_NAME, TRAINING_ARGS_NAME = trainer_file_names()


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _optimizer_file(directory: str) -> str:
    return os.path.join(directory, f"optimizer-rank{dist.get_rank():05d}-of-{dist.get_world_size():05d}.pt")


class MoETrainer(Trainer):
    """A `transformers.Trainer` that checkpoints and resumes expert-parallel hf_moe models (see the module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self._expert_parallel and self.args.world_size != dist.get_world_size():
            raise ValueError(
                f"The model is expert-parallel over {dist.get_world_size()} processes, but TrainingArguments "
                f"sees world_size={self.args.world_size}: every process would train on the same batches and the "
                "experts' gradients would not match the data. On a machine without GPUs pass "
                "TrainingArguments(use_cpu=True) (transformers runs several CPU processes only then); otherwise "
                "launch with torchrun / accelerate launch so that TrainingArguments sees every process."
            )

    @property
    def _expert_parallel(self) -> bool:
        return getattr(_unwrap(self.model), "expert_parallel_plan", None) is not None

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        if not self._expert_parallel:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        _unwrap(self.model).save_pretrained(output_dir, is_main_process=self.args.should_save)  # every rank
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._expert_parallel:
            return super()._save_optimizer_and_scheduler(output_dir)
        torch.save(self.optimizer.state_dict(), _optimizer_file(output_dir))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._expert_parallel:
            return super()._load_optimizer_and_scheduler(checkpoint)
        path = _optimizer_file(checkpoint)
        if not os.path.isfile(path):
            found = sorted(f for f in os.listdir(checkpoint) if f.startswith("optimizer"))
            raise FileNotFoundError(
                f"{checkpoint} has no optimizer state for this rank ({os.path.basename(path)}; found {found}). "
                "Resuming restores each rank's optimizer state, so it needs the same number of processes and "
                "expert-parallel size as the run that saved it. (The model weights load with any layout.)"
            )
        self.optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))  # moved to the params
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
