"""First light on a GPU, in one command: `python -m hf_moe.gpu_check [--out DIR] [--smoke]`.

What a session lent a GPU runs first (one call, under 10 minutes on an H100). It writes DIR/report.md and
DIR/results.json (default DIR: gpu_check/), rewritten after each step, in this order:

  1. the environment: `nvidia-smi`, `python -m hf_moe.env`;
  2. tests/test_triton.py on CUDA without the interpreter (HF_MOE_BACKEND=triton);
  3. `compute-sanitizer --tool memcheck` on the small kernel tests, where the tool is present;
  4. correctness at Mixtral-like and Qwen3-30B-A3B-like shapes: balanced, skewed and dropped routing; forward, dX
     and dW of the Triton backend against the torch backend; zero gradients for experts without rows; no NaN with
     a poisoned allocator; one tensor past 2**31 elements (correctness.py);
  5. the speed table at 16,384 tokens in bf16: hf_moe triton, hf_moe torch, transformers' grouped_mm, and a dense
     MLP of the same active FLOPs, median and spread (speed.py);
  6. a training step of a converted model (bf16 autocast, after `hf_moe.ops.warmup`), and an EP x FSDP2 step
     over NCCL where there are 2 or more GPUs (ep_step.py).

`--smoke` runs the same steps on CPU tensors under TRITON_INTERPRET=1 at tiny shapes (CI runs it, so the command
cannot rot). What needs a GPU runs at a tiny scale there and says so, or is reported "skipped: <why>": nothing is
faked. The exit status is 0 when no step failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_moe.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check", help="where report.md and results.json go (default: gpu_check)")
    parser.add_argument("--smoke", action="store_true", help="CPU tensors, TRITON_INTERPRET=1, tiny shapes (CI)")
    parser.add_argument("--budget", type=float, default=570, help="seconds for the whole run (default 570)")
    args = parser.parse_args(argv)
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton binds its kernels to the interpreter when they are defined: set it before anything imports them.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        os.execve(sys.executable, [sys.executable, "-m", "hf_moe.gpu_check", *(argv or sys.argv[1:])], env)

    import torch

    from .correctness import step_correctness
    from .record import Report
    from .speed import step_speed
    from .steps import step_environment, step_sanitizer, step_training_and_expert_parallel, step_triton_tests

    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device is visible: run on a GPU, or add --smoke to run the same steps on CPU")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    deadline = time.monotonic() + args.budget

    def left(reserve: float, most: float) -> float:
        """Seconds a subprocess step may take: at most `most`, leaving `reserve` for the steps after it."""
        return max(30.0, min(most, deadline - time.monotonic() - reserve))

    context = dict(mode="--smoke (CPU tensors, TRITON_INTERPRET=1, tiny shapes)" if args.smoke else "GPU",
                   started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), torch=torch.__version__)
    report = Report(Path(args.out), "hf_moe gpu_check", context)
    report.run(1, "environment", step_environment, args.smoke)
    report.run(2, "tests/test_triton.py", step_triton_tests, args.smoke, left(300, 240))
    report.run(3, "compute-sanitizer memcheck", step_sanitizer, args.smoke, left(200, 120))
    report.run(4, "correctness at real shapes", step_correctness, device, args.smoke)
    report.run(5, "speed at 16k tokens, bf16", step_speed, device, args.smoke)
    report.run(6, "training step, and EP x FSDP2", step_training_and_expert_parallel, device, args.smoke,
               left(60, 150))
    print(f"[gpu_check] {'passed' if report.passed else 'FAILED'}; see {report.out / 'report.md'}", flush=True)
    return 0 if report.passed else 1
