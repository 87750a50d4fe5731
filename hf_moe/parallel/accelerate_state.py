"""`accelerator.save_state` / `load_state` for an expert-parallel model trained under DDP (Accelerate's default loop).

    model, optimizer = accelerator.prepare(model, optimizer)
    hf_moe.parallel.register_for_checkpointing(accelerator, model, optimizer)
    ...
    accelerator.save_state("ckpt")      # every process
    accelerator.load_state("ckpt")      # on any number of processes, any expert-parallel layout

Under DDP Accelerate writes the model and the optimizer from rank 0 alone (model.safetensors, optimizer.bin), which
holds only its own experts (DTensors, which safetensors cannot even write). What this adds, through Accelerate's own
hooks (`register_save_state_pre_hook`, `register_load_state_pre_hook`, `register_for_checkpointing`):

    save   before Accelerate writes: the model and optimizer, every process its shards, with
           `hf_moe.parallel.save_training_state` into `<dir>/expert_parallel/` (DCP, atomic); the experts are then
           left out of rank 0's model.safetensors (which keeps the other parameters)
    load   Accelerate does not load model.safetensors into this model; after it has loaded the optimizer (rank 0's
           file, with rank 0's expert states) and the RNG, `load_training_state` puts back the model and the whole
           optimizer, resharded to the current layout

Accelerate's RNG, scheduler, sampler and step files are its own, unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .training_state import load_training_state, save_training_state

STATE_DIR = "expert_parallel"


def _unwrap(model):
    while hasattr(model, "module"):  # DistributedDataParallel, and Accelerate's other wrappers
        model = model.module
    return model


class _LoadedLater(nn.Module):
    """Stands in for the model in the list of models Accelerate loads (the list keeps its length, so every other
    model still reads its own file): the model's weights are loaded with its optimizer state, later."""

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return super().load_state_dict({}, strict=False)  # no missing and no unexpected keys


class _ExpertParallelState:
    """The hooks and the checkpointed object of one (model, optimizer); see the module docstring."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = _unwrap(model), getattr(optimizer, "optimizer", optimizer)
        self.loading_from: Path | None = None

    def _index(self, models) -> int | None:
        return next((i for i, m in enumerate(models) if _unwrap(m) is self.model), None)

    def before_save(self, models, weights, output_dir) -> None:
        i = self._index(models)
        if i is None or i >= len(weights):  # (not saved through `weights`: Accelerate's FSDP or DeepSpeed path)
            return
        save_training_state(Path(output_dir) / STATE_DIR, self.model, self.optimizer)
        for key in [key for key, value in weights[i].items() if isinstance(value, DTensor)]:
            del weights[i][key]

    def before_load(self, models, input_dir) -> None:
        i = self._index(models)
        if i is None:
            return
        directory = Path(input_dir) / STATE_DIR
        if not directory.is_dir():
            raise FileNotFoundError(
                f"{input_dir} has no {STATE_DIR}/: it was saved without "
                "hf_moe.parallel.register_for_checkpointing, so it holds rank 0's experts only. Load weights saved "
                "with save_pretrained instead (MoEForCausalLM.from_pretrained(path, expert_parallel=True))."
            )
        models[i] = _LoadedLater()  # the weights come with the optimizer state, after Accelerate's files
        self.loading_from = directory

    def state_dict(self) -> dict:
        return {"directory": STATE_DIR}

    def load_state_dict(self, state: dict) -> None:
        if self.loading_from is None:
            return
        # Accelerate has loaded rank 0's optimizer file into every process: its DTensor states (the experts') hold
        # rank 0's shards, and the mesh coordinates they were pickled with. Give them this process's placement
        # first, so that DCP reads this process's shards into them.
        for param, param_state in self.optimizer.state.items():
            for key, value in param_state.items():
                if isinstance(param, DTensor) and isinstance(value, DTensor) and value.shape == param.shape:
                    param_state[key] = torch.zeros_like(param, dtype=value.dtype)
        load_training_state(self.loading_from, self.model, self.optimizer)
        self.loading_from = None


def register_for_checkpointing(accelerator, model, optimizer) -> None:
    """Make `accelerator.save_state` / `load_state` save and restore an expert-parallel `model` (prepared, or not
    yet) and its `optimizer` under DDP, whatever the number of processes and layout on load. Call it once, after
    `accelerator.prepare`, in the run that saves and in the run that loads (Accelerate counts the objects
    registered for checkpointing).

    Raises:
        ValueError: if the model is not expert-parallel (Accelerate saves such a model by itself).
    """
    state = _ExpertParallelState(model, optimizer)
    if getattr(state.model, "expert_parallel_plan", None) is None:
        raise ValueError(
            f"{type(state.model).__name__} is not expert-parallel: accelerator.save_state saves it without "
            "hf_moe.parallel.register_for_checkpointing."
        )
    accelerator.register_save_state_pre_hook(state.before_save)
    accelerator.register_load_state_pre_hook(state.before_load)
    accelerator.register_for_checkpointing(state)
