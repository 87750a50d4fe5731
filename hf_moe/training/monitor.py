"""`MoEMonitorCallback`: routing statistics per MoE layer, at the Trainer's logging steps."""

from __future__ import annotations

import importlib.util
import math
import os
import time

from transformers import TrainerCallback


def _unwrap(model):
    while hasattr(model, "module"):  # DDP / DataParallel
        model = model.module
    return model


def _tensorboard_dir(args) -> str:
    """The run directory of transformers' TensorBoardCallback: $TENSORBOARD_LOGGING_DIR, or the newest
    output_dir/runs/* (it makes one when training starts, before any log), or a new one."""
    if os.getenv("TENSORBOARD_LOGGING_DIR"):
        return os.path.expanduser(os.environ["TENSORBOARD_LOGGING_DIR"])
    runs = os.path.join(args.output_dir, "runs")
    existing = [os.path.join(runs, d) for d in os.listdir(runs)] if os.path.isdir(runs) else []
    existing = [d for d in existing if os.path.isdir(d)]
    if existing:
        return max(existing, key=os.path.getmtime)
    return os.path.join(runs, time.strftime("%b%d_%H-%M-%S") + "_hf_moe")


class MoEMonitorCallback(TrainerCallback):
    """Log how the routers route, per MoE layer, at the Trainer's logging steps.

        trainer = Trainer(model=moe, args=args, train_dataset=data, callbacks=[hf_moe.MoEMonitorCallback()])

    For each MoE layer `i`, over the training forwards since the previous log:

        moe/layer_i/load_cv              coefficient of variation of the tokens per expert (0 = balanced)
        moe/layer_i/load_max_over_mean   the busiest expert's load over the mean load
        moe/layer_i/drop_fraction        (token, slot) pairs dropped by capacity
        moe/layer_i/router_entropy       mean entropy of the router distribution (nats)
        moe/layer_i/aux_loss, z_loss     balancing and z losses, without their coefficients
        moe/layer_i/load/expert_j        share of the layer's pairs computed by expert j (with `per_expert=True`)

    plus `moe/mean/...` over layers. The numbers go into the Trainer's log history (trainer_state.json), to
    TensorBoard and Weights & Biases when they are in `report_to` and installed, and to `self.history`.
    """

    def __init__(self, per_expert: bool = True):
        self.per_expert = per_expert
        self.history: list[dict] = []
        self._tensorboard = None

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):
        if model is None or not hasattr(_unwrap(model), "routing_stats"):
            return
        stats = _unwrap(model).routing_stats
        if stats.forwards == 0:
            return
        metrics = self.metrics(stats.summary())
        stats.reset()
        self.history.append({"step": state.global_step, **metrics})
        if logs is not None:
            logs.update(metrics)
        if state.log_history:
            state.log_history[-1].update(metrics)
        if state.is_world_process_zero:
            self._report(args, state, metrics)

    def metrics(self, summary: list[dict]) -> dict[str, float]:
        out: dict[str, float] = {}
        keys = ["load_cv", "load_max_over_mean", "drop_fraction", "router_entropy", "aux_loss", "z_loss"]
        for layer, values in enumerate(summary):
            for key in keys:
                out[f"moe/layer_{layer}/{key}"] = values[key]
            if self.per_expert:
                for expert, share in enumerate(values["load"]):
                    out[f"moe/layer_{layer}/load/expert_{expert}"] = share
        for key in keys:
            vals = [values[key] for values in summary]
            out[f"moe/mean/{key}"] = math.fsum(vals) / len(vals)
        return out

    def _report(self, args, state, metrics: dict[str, float]) -> None:
        report_to = args.report_to or []
        if "tensorboard" in report_to and importlib.util.find_spec("tensorboard") is not None:
            if self._tensorboard is None:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(log_dir=_tensorboard_dir(args))
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, value, state.global_step)
            self._tensorboard.flush()
        if "wandb" in report_to and importlib.util.find_spec("wandb") is not None:
            import wandb

            if wandb.run is not None:
                wandb.log(metrics, step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
