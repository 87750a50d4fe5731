"""Fine-tune a converted MoE model with `transformers.Trainer` (hf_moe.MoETrainer) on a local text or JSON(L) file.

    python examples/finetune_trainer.py --model out/moe --data corpus.txt --output-dir out/moe-ft --max-steps 50

Expert-parallel over the processes of `accelerate launch` / `torchrun` with --expert-parallel: each rank reads and
holds a block of every layer's experts, and FSDP2 shards the other parameters (`hf_moe.parallelize`; see
hf_moe.parallel). Under Accelerate's FSDP2 plugin, Accelerate shards the other parameters instead:

    accelerate launch --num_processes 8 examples/finetune_trainer.py --expert-parallel --model out/moe ...
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 8 examples/finetune_trainer.py --expert-parallel ...

(On a machine without GPUs: `accelerate launch --multi_gpu --num_processes 2 ...` runs CPU processes on gloo;
Accelerate refuses FSDP there, so use the first form.) Checkpoints resume on any number of processes with the same
global batch (--batch-size x processes x --gradient-accumulation-steps).

The data file is read with `datasets`: a .txt file (one document per line), or a .json/.jsonl file with a "text"
field or a "messages" field (chat turns, rendered with the tokenizer's chat template). Texts are tokenised,
concatenated and cut into blocks of --block-size tokens. The loss Trainer logs is
the LM loss plus `router_aux_loss_coef` x the load-balancing loss. The model is saved per expert in
--output-dir (Trainer's checkpoints too), and a run resumes with --resume.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from datasets import load_dataset
from transformers import AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

import hf_moe
from hf_moe.compat import enable_activation_checkpointing


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a directory saved by hf_moe (hf-moe convert / save_pretrained)")
    p.add_argument("--data", required=True, help="local .txt, .json or .jsonl file")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--optim", default="adamw_torch",
                   help="Trainer's optimizer name (TrainingArguments.optim). adafactor keeps factored second moments "
                        "and no first moment: its states are a few MB where AdamW's are twice the fp32 weights")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="the weights' dtype (default: the checkpoint's). bfloat16 halves them, but an update smaller "
                        "than half a bf16 step is lost")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequential", action="store_true", help="no shuffling (to compare runs batch for batch)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="shard the experts over the launched processes, and the other parameters with FSDP2")
    p.add_argument("--expert-parallel-size", type=int,
                   help="processes per expert-parallel group (default: all); the groups then FSDP-shard each block")
    return p.parse_args(argv)


def load_blocks(path: str, tokenizer, block_size: int):
    """The data file as a Dataset of `input_ids` blocks of `block_size` tokens."""
    if not os.path.isfile(path):
        sys.exit(f"error: --data {path!r} is not a file")
    kind = {".txt": "text", ".json": "json", ".jsonl": "json"}.get(os.path.splitext(path)[1])
    if kind is None:
        sys.exit(f"error: --data must be a .txt, .json or .jsonl file, got {path!r}")
    raw = load_dataset(kind, data_files=path, split="train")
    if "messages" in raw.column_names and "text" not in raw.column_names:
        if tokenizer.chat_template is None:
            sys.exit(f"error: {path} holds chat `messages`, but the tokenizer has no chat template; use a `text` field")
        raw = raw.map(lambda row: {"text": tokenizer.apply_chat_template(row["messages"], tokenize=False)})
    if "text" not in raw.column_names:
        sys.exit(f"error: {path} has neither a 'text' nor a 'messages' field (columns: {raw.column_names})")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    tokens = raw.map(lambda b: {"ids": [tokenizer(t)["input_ids"] + eos for t in b["text"]]}, batched=True,
                     remove_columns=raw.column_names)

    def group(batch):
        flat = [t for ids in batch["ids"] for t in ids]
        n = len(flat) // block_size * block_size
        return {"input_ids": [flat[i : i + block_size] for i in range(0, n, block_size)]}

    blocks = tokens.map(group, batched=True, remove_columns=["ids"])
    if len(blocks) == 0:
        sys.exit(f"error: {path} has fewer than --block-size={block_size} tokens")
    return blocks


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        optim=args.optim,
        lr_scheduler_type="constant",
        logging_steps=args.logging_steps,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),  # else transformers runs CPU processes as separate single ones
        train_sampling_strategy="sequential" if args.sequential else "random",
        disable_tqdm=True,
    )
    _ = training_args.device  # sets up torch.distributed under accelerate launch / torchrun
    model = hf_moe.MoEForCausalLM.from_pretrained(
        args.model, expert_parallel=args.expert_parallel, expert_parallel_size=args.expert_parallel_size,
        **({} if args.dtype == "auto" else {"dtype": getattr(torch, args.dtype)}),
    )
    if args.gradient_checkpointing:
        enable_activation_checkpointing(model)  # (gradient_checkpointing_enable before transformers 5.23)
    if args.expert_parallel and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        hf_moe.parallelize(model)  # FSDP2 for the non-expert parameters (Accelerate's FSDP2 plugin does it otherwise)
    train = load_blocks(args.data, tokenizer, args.block_size)
    counts = model.parameter_counts()
    if training_args.process_index == 0:
        print(f"{len(train)} blocks of {args.block_size} tokens; model {counts['total'] / 1e6:.1f}M parameters "
              f"({counts['active'] / 1e6:.1f}M active per token); {training_args.world_size} process(es)"
              + (", experts and FSDP2 shards across them" if args.expert_parallel else ""))
    trainer = hf_moe.MoETrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=args.resume or None)
    trainer.save_model(args.output_dir)
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    if training_args.process_index == 0:
        print("step  loss")
        for step, loss in losses:
            print(f"{step:>4}  {loss:.4f}")
        with open(os.path.join(args.output_dir, "loss_curve.json"), "w") as f:
            json.dump(losses, f)
    return {"losses": losses}


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # exit cleanly under torchrun / accelerate launch (gloo threads)
        torch.distributed.destroy_process_group()
