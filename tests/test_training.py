"""Fine-tuning a converted model: transformers.Trainer (with resume), a plain Accelerate loop, the example."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from conftest import CORPUS, VOCAB, random_ids, tiny_dense, tiny_tokenizer
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from hf_moe import MoEForCausalLM, convert_to_moe

pytestmark = pytest.mark.oldest

ROOT = Path(__file__).resolve().parents[1]


def _dataset(n=48, length=16, seed=0):
    # Learnable: each row is a fixed random sequence repeated, so the loss can fall well below log(VOCAB).
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(3, VOCAB, (4, length), generator=g).repeat(n // 4, 1)
    return Dataset.from_dict({"input_ids": rows.tolist(), "labels": rows.tolist()})


def _args(out, **kwargs):
    defaults = dict(per_device_train_batch_size=8, max_steps=12, learning_rate=3e-3, logging_steps=1,
                    report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0, data_seed=0,
                    lr_scheduler_type="constant")
    return TrainingArguments(str(out), **{**defaults, **kwargs})


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_loss_falls(tmp_path):
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2)
    trainer = Trainer(model=moe, args=_args(tmp_path, gradient_accumulation_steps=2), train_dataset=_dataset())
    trainer.train()
    losses = _losses(trainer)
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0], losses


def test_trainer_resume_from_checkpoint_continues_exactly(tmp_path):
    data = _dataset()
    # 2 steps, a checkpoint, 2 more: resuming has to restore the weights, AdamW's moments and the data position.
    args = _args(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2)
    full = Trainer(model=convert_to_moe(tiny_dense(), num_experts=4, top_k=2), args=args, train_dataset=data)
    full.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "model-expert-00003.safetensors").is_file() and (checkpoint / "optimizer.pt").is_file()
    umask = os.umask(0o022)
    os.umask(umask)  # (safetensors 0.8 writes 0600: other users could not read a Trainer checkpoint)
    assert {p.stat().st_mode & 0o777 for p in checkpoint.glob("*.safetensors")} == {0o666 & ~umask}

    # A different starting model: every weight must come from the checkpoint for the runs to agree.
    other = convert_to_moe(tiny_dense(seed=7), num_experts=4, top_k=2, seed=5)
    resumed = Trainer(model=other, args=args, train_dataset=data)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert _losses(resumed)[-2:] == pytest.approx(_losses(full)[-2:], rel=1e-5)
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    reloaded = MoEForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-4")
    ids = random_ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(ids).logits, full.model.eval()(ids).logits)


def test_accelerate_loop_trains():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    moe = convert_to_moe(tiny_dense("qwen3"), num_experts=4, top_k=2).train()
    optimizer = torch.optim.AdamW(moe.parameters(), lr=3e-3)
    data = _dataset().with_format("torch")
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    moe, optimizer, loader = accelerator.prepare(moe, optimizer, loader)
    losses = []
    for _ in range(3):
        for batch in loader:
            with accelerator.accumulate(moe):
                out = moe(input_ids=batch["input_ids"], labels=batch["labels"])
                accelerator.backward(out.loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(out.loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--optim", "adafactor", "--dtype", "bfloat16"]], ids=["default", "quickstart"])
def test_finetune_example_runs_and_saves_a_loadable_model(extra, tmp_path):
    """Trainer's defaults, and the quickstart's settings (bf16 weights, Adafactor: examples/smollm2_moe.py)."""
    tokenizer = tiny_tokenizer()
    moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2)
    moe.save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    (tmp_path / "data.txt").write_text("\n".join([CORPUS] * 20))
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import finetune_trainer
    finally:
        sys.path.pop(0)
    out = tmp_path / "ft"
    result = finetune_trainer.main([
        "--model", str(tmp_path / "moe"), "--data", str(tmp_path / "data.txt"), "--output-dir", str(out),
        "--max-steps", "12", "--block-size", "32", "--batch-size", "4", "--learning-rate", "3e-3",
        "--logging-steps", "3", *extra,
    ])
    losses = [loss for _, loss in result["losses"]]
    assert losses[-1] < losses[0]
    assert json.loads((out / "loss_curve.json").read_text())[0][0] == 3
    reloaded = MoEForCausalLM.from_pretrained(out)
    assert reloaded.dtype == (torch.bfloat16 if extra else torch.float32)
    assert (out / "tokenizer.json").is_file() and (out / "model-expert-00000.safetensors").is_file()
    ids = tokenizer("the quick", return_tensors="pt")["input_ids"]
    assert reloaded.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, ids.shape[1] + 4)


class _GradCapture:
    """A TrainerCallback that keeps the gradients seen just before the first optimizer step."""

    def __init__(self):
        from transformers import TrainerCallback

        outer = self

        class _Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if not outer.grads:
                    outer.grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

        self.grads: dict[str, torch.Tensor] = {}
        self.callback = _Callback()


@pytest.mark.parametrize("accumulation", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_aux_loss_weight_does_not_grow_with_gradient_accumulation(tmp_path, accumulation):
    """Identical micro-batches: with the losses weighted right, accumulating 2 or 4 of them gives the same
    gradient as 1. (Summing per-micro-batch aux losses would make the router gradient grow with the count.)"""
    row = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": row.repeat(8, 1).tolist(), "labels": row.repeat(8, 1).tolist()})
    grads = []
    for steps in (1, accumulation):
        capture = _GradCapture()
        moe = convert_to_moe(tiny_dense(), num_experts=4, top_k=2, router_aux_loss_coef=1.0, router_z_loss_coef=0.1)
        args = _args(tmp_path / str(steps), per_device_train_batch_size=2, gradient_accumulation_steps=steps,
                     max_steps=1, learning_rate=0.0, max_grad_norm=0.0)
        Trainer(model=moe, args=args, train_dataset=data, callbacks=[capture.callback]).train()
        grads.append(capture.grads)
    assert "model.layers.0.mlp.gate.weight" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)
