"""First light on a GPU, in one command: `python -m hf_moe.gpu_check [--out DIR] [--budget S] [--smoke]`.

What a session lent a GPU runs first (`scripts/first_light.sh` runs it there). Each step runs in a child process of
its own with its own time limit (runner.py): a crash or a hang costs that step only, and DIR/report.md,
DIR/results.json and DIR/logs.txt (every step's whole output) are rewritten after each. The steps, in the order of
their value, share `--budget` seconds (default 420: one 10-minute device call with room for a rerun):

  1. the environment: `nvidia-smi`, `python -m hf_moe.env`;
  2. correctness at Mixtral-like and Qwen3-30B-A3B-like shapes: balanced, skewed and dropped routing; forward, dX
     and dW of the Triton backend against the torch backend; zero gradients for experts without rows; no NaN with
     a poisoned allocator; one tensor past 2**31 elements (correctness.py);
  3. the speed table at 16,384 tokens in bf16: hf_moe triton, hf_moe torch, transformers' grouped_mm, and a dense
     MLP of the same active FLOPs, median and spread (speed.py);
  4. a training step of a converted model (bf16 autocast, after `hf_moe.ops.warmup`) on the Triton backend against
     the torch backend; what HF_MOE_BACKEND=auto runs for bf16 and fp32 experts on this GPU, executed
     (default_choice.py); and an EP x FSDP2 step over NCCL where there are 2 or more GPUs (ep_step.py);
  5. the Triton tests (tests/test_triton_*.py, marked gpu) on CUDA without the interpreter (HF_MOE_BACKEND=triton);
  6. `compute-sanitizer --tool memcheck` on the small kernel tests, with what is left of the budget.

The run fails (exit status 1) when a step fails, and any Triton op that fell back to torch in any step fails its
step: report.md names each op and its error, and no row of the speed table is labelled Triton where torch ran.
Nothing is compiled for the CPU inside the budget: the steps run with HF_MOE_BACKEND=triton, which never builds the
C++ extension (step 4's check of the default runs auto on CUDA tensors only).

`--smoke` runs the same steps on CPU tensors under TRITON_INTERPRET=1 at tiny shapes (CI runs it, so the command
cannot rot). What needs a GPU runs at a tiny scale there and says so, or is reported "skipped: <why>": nothing is
faked. `--steps correctness,speed` runs some of the steps (keys: environment, correctness, speed, training,
triton-tests, sanitizer).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

from .record import Report
from .runner import StepSpec, chosen_steps, run_steps

STEPS = [
    StepSpec("environment", "environment", "hf_moe.gpu_check.steps:step_environment", most=60, least=10),
    StepSpec("correctness", "correctness at real shapes", "hf_moe.gpu_check.correctness:step_correctness",
             most=150, least=60),
    StepSpec("speed", "speed at 16k tokens, bf16", "hf_moe.gpu_check.speed:step_speed", most=110, least=45),
    StepSpec("training", "training step, and EP x FSDP2", "hf_moe.gpu_check.steps:step_training_and_expert_parallel",
             most=90, least=40),
    StepSpec("triton-tests", "tests/test_triton_*.py", "hf_moe.gpu_check.steps:step_triton_tests", most=240,
             least=40),
    StepSpec("sanitizer", "compute-sanitizer memcheck", "hf_moe.gpu_check.steps:step_sanitizer", most=None, least=30),
]
BUDGET = 420.0
# Under --smoke (CPU, Triton's interpreter, 2 cores) each step takes several times its GPU time.
SMOKE_SCALE, SMOKE_BUDGET = 4.0, 1500.0


def _versions() -> str:
    """Python and the installed torch, triton, transformers, numpy (read without importing them)."""
    import importlib.metadata

    found = [f"python {platform.python_version()}"]
    for name in ("torch", "triton", "transformers", "accelerate", "numpy"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def _seconds(text: str) -> float:
    """`--budget`'s value: a finite number of seconds above 0. NaN would make every step's limit NaN, and a wait with a
    NaN timeout never times out: a hung step, the case the runner exists for, would never be killed."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (e.g. 420)") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds above 0 (e.g. 420)")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_moe.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check",
                        help="where report.md, results.json and logs.txt go (default: gpu_check)")
    parser.add_argument("--smoke", action="store_true", help="CPU tensors, TRITON_INTERPRET=1, tiny shapes (CI)")
    parser.add_argument("--budget", type=_seconds, default=None,
                        help=f"seconds for the whole run (default {BUDGET:.0f}; {SMOKE_BUDGET:.0f} with --smoke)")
    parser.add_argument("--steps", default=None,
                        help="comma-separated keys of the steps to run (default: all): "
                             + ", ".join(s.key for s in STEPS))
    args = parser.parse_args(argv)
    specs = chosen_steps(parser, args.steps, STEPS, STEPS)
    budget = args.budget if args.budget is not None else (SMOKE_BUDGET if args.smoke else BUDGET)
    least = sum(s.least for s in specs)
    if budget < least:  # else the first steps (the environment, which decides whether any can run) are skipped
        parser.error(f"--budget {budget:g} is under the {least:.0f} s that the steps need at least ("
                     + ", ".join(f"{s.key} {s.least:.0f}" for s in specs) + "): give more, or fewer --steps")
    env = {**os.environ}
    env.setdefault("HF_MOE_BACKEND", "triton")  # never builds the C++ extension (not needed: no CPU kernels run)
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"  # Triton binds its kernels to the interpreter when the child imports them
    else:
        env.pop("TRITON_INTERPRET", None)
    context = dict(mode="--smoke (CPU tensors, TRITON_INTERPRET=1, tiny shapes)" if args.smoke else "GPU",
                   started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), versions=_versions(), budget=f"{budget:g} s",
                   HF_MOE_BACKEND=env["HF_MOE_BACKEND"])
    report = Report(Path(args.out), "hf_moe gpu_check", context)

    def cannot_run(step) -> bool:  # the environment step found that Triton cannot run here (no GPU, say)
        return step.data.get("runnable") is False

    run_steps(specs, report, budget, args.smoke, env, SMOKE_SCALE if args.smoke else 1.0, stop_after=cannot_run,
              numbers=[STEPS.index(spec) + 1 for spec in specs],  # a step keeps its number when others are left out
              fork=args.smoke)
    return report.conclude("gpu_check")


if __name__ == "__main__":
    sys.exit(main())
