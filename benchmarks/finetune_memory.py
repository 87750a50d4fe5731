"""What the quickstart's fine-tuning step costs in memory with each optimizer, and what it does to the loss curve.

    python benchmarks/finetune_memory.py --model smollm2-moe-work/smollm2-moe-8x-top2 [--max-steps 10] [--repeats 1]
        [--configs adamw_torch:float32,adafactor:bfloat16:5e-4,adafactor:float32,adafactor:bfloat16]

Runs examples/finetune_trainer.py as examples/smollm2_moe.py does (batch 2, blocks of 64 tokens,
examples/data/moe_chat.jsonl, seed 0), once per optimizer:dtype[:learning rate] configuration (lr 5e-5, the
quickstart's former rate, unless given) and repeat, each in a fresh process,
the configurations interleaved. Prints, per configuration: the process's peak resident memory (`ru_maxrss` from
`wait4`, the page cache of the memory-mapped checkpoint included, as `top` shows it), the wall time (median and
range over the repeats), and the loss at each logged step, side by side with the first configuration's.

The weights of an 8-expert top-2 SmolLM2-135M are 692M fp32 parameters (2.8 GB). AdamW adds an fp32 gradient and
two fp32 moments per parameter (3 x 2.8 GB); Adafactor keeps a row and a column second moment per matrix and no
first moment (a few MB); bf16 weights halve weights, gradients and AdamW's moments but round away every update
smaller than half a bf16 step (2^-9 to 2^-8 of the weight): at lr 5e-5 that is 93% of SmolLM2's MLP updates, at
5e-4 19%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(model: str, optim: str, dtype: str, lr: str, steps: int, out: str) -> dict:
    """One fine-tuning process: its peak RSS (GB), wall time (s) and logged losses."""
    cmd = [sys.executable, os.path.join(ROOT, "examples", "finetune_trainer.py"), "--model", model,
           "--data", os.path.join(ROOT, "examples", "data", "moe_chat.jsonl"), "--output-dir", out,
           "--max-steps", str(steps), "--batch-size", "2", "--block-size", "64", "--learning-rate", lr,
           "--logging-steps", "1", "--optim", optim, "--dtype", dtype]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    stderr = child.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    with open(os.path.join(out, "loss_curve.json")) as f:
        losses = [loss for _, loss in json.load(f)]
    return {"peak_gb": usage.ru_maxrss * 1024 / 1e9, "seconds": seconds, "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an hf_moe checkpoint (the quickstart's converted SmolLM2)")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--configs",
                   default="adamw_torch:float32,adafactor:bfloat16:5e-4,adafactor:float32,adafactor:bfloat16",
                   help="optimizer:dtype[:lr], comma-separated (the first is the reference)")
    args = p.parse_args()
    configs = [tuple((c + ":5e-5").split(":")[:3]) for c in args.configs.split(",")]  # optim:dtype[:lr]
    results: dict[tuple, list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as work:
        for repeat in range(args.repeats):
            for optim, dtype, lr in configs:
                out = os.path.join(work, f"{optim}-{dtype}-{lr}-{repeat}")
                results[(optim, dtype, lr)].append(run(args.model, optim, dtype, lr, args.max_steps, out))
                r = results[(optim, dtype, lr)][-1]
                print(f"  {optim} {dtype} lr {lr} repeat {repeat}: peak {r['peak_gb']:.2f} GB, {r['seconds']:.0f} s, "
                      f"losses {' '.join(f'{x:.3f}' for x in r['losses'])}", flush=True)

    first = results[configs[0]][0]["losses"]
    print(f"\nfine-tuning {args.max_steps} steps, {args.repeats} repeat(s) each; loss of the first repeat")
    print(f"{'optimizer':<12} {'weights':<9} {'lr':<6} {'peak GB':>8} {'wall s (median [min-max])':>26}  "
          f"loss: first, last, mean over steps (first config: {first[0]:.3f}, {first[-1]:.3f})")
    for (optim, dtype, lr), runs in results.items():
        peaks = [r["peak_gb"] for r in runs]
        times = [r["seconds"] for r in runs]
        losses = runs[0]["losses"]
        wall = f"{statistics.median(times):.0f} [{min(times):.0f}-{max(times):.0f}]"
        print(f"{optim:<12} {dtype:<9} {lr:<6} {max(peaks):>8.2f} {wall:>26}  {losses[0]:.3f}, {losses[-1]:.3f}, "
              f"{statistics.mean(losses):.3f}")
    print("\nloss per step")
    print("step " + " ".join(f"{':'.join(c):>26}" for c in configs))
    for i in range(len(first)):
        print(f"{i + 1:>4} " + " ".join(f"{results[c][0]['losses'][i]:>26.4f}" for c in configs))


if __name__ == "__main__":
    main()
