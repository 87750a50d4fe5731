"""One Trainer step per OUT ACCUMULATION ROWS triple; rank 0 saves every parameter's gradient (before the optimizer
step) to OUT. Several triples run one after the other in the same processes (a launch costs more than a step).

    torchrun --nproc_per_node 2 tests/dist/aux_loss_trainer.py OUT 1 mixed  # DDP, 2 ranks, no accumulation
    torchrun --nproc_per_node 1 tests/dist/aux_loss_trainer.py OUT 2 mixed  # 1 process, 2 accumulation steps

Both see the same two micro-batches (global batch order is seeded), so with correct loss weighting the
gradients are equal. With `same`, every row is the same sequence, so any number of ranks or micro-batches
must give the gradient of one micro-batch. Launched by tests/test_distributed.py.
"""

import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import VOCAB, tiny_dense  # noqa: E402

from hf_moe import convert_to_moe  # noqa: E402


class SaveGrads(TrainerCallback):
    def __init__(self, path):
        self.path = path

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            torch.save({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
                       self.path)


def main(out: str, accumulation: int, rows_kind: str) -> None:
    torch.manual_seed(0)  # (each run starts from the same seed, whatever ran before it in this process)
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_aux_loss_coef=1.0, router_z_loss_coef=0.1)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, VOCAB, (8, 12), generator=g)
    labels = rows.clone()
    if rows_kind == "same":
        rows, labels = rows[:1].repeat(8, 1), labels[:1].repeat(8, 1)
    else:
        labels[::3, :4] = -100  # uneven label counts per micro-batch
    data = Dataset.from_dict({"input_ids": rows.tolist(), "labels": labels.tolist()})
    args = TrainingArguments(
        out + ".run", per_device_train_batch_size=2, gradient_accumulation_steps=accumulation, max_steps=1,
        learning_rate=0.0, max_grad_norm=0.0, report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True,
        ddp_backend="gloo", seed=0, data_seed=0, average_tokens_across_devices=True,
    )
    Trainer(model=moe, args=args, train_dataset=data, callbacks=[SaveGrads(out)]).train()


def finish() -> None:
    # Trainer leaves the process group open; gloo threads still running at interpreter teardown can abort the
    # process ("terminate called without an active exception") after the work is done.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Even after destroy_process_group a gloo thread can outlive the interpreter's teardown and abort the process
    # (seen once on a loaded machine). The results are written: leave without running the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    runs = sys.argv[1:]
    for i in range(0, len(runs), 3):
        main(runs[i], int(runs[i + 1]), runs[i + 2])
    finish()
