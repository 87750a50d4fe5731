"""Second light on a GPU, in one command: `python -m hf_moe.gpu_check.bench [--out DIR] [--budget S] [--smoke]`
(`scripts/gpu_bench.sh` runs it on a lent GPU, with Liger-Kernel's wheel installed first).

The same runner and report as `python -m hf_moe.gpu_check` (runner.py, record.py): each step in a child process of
its own with its own time limit, DIR/report.md, DIR/results.json and DIR/logs.txt rewritten after each step. The
steps, in the order of their value, share `--budget` seconds (default 440: one device call of at most ~480 s with
the script's margins, leaving room for a rerun):

  1. the environment (steps.step_environment): nvidia-smi, `python -m hf_moe.env`; stops the run if Triton cannot
     run here;
  2. correctness at real shapes (correctness.step_correctness, as first light runs it): the Triton backend against
     the torch backend, the allocator filled with NaN first, one tensor past 2**31 elements;
  3. layer speed (layer_bench.py): Qwen3-30B-A3B-, OLMoE-, DeepSeek-V2-Lite- and Mixtral-like layers at 16,384 and
     32,768 tokens, forward and forward+backward TF/s on active FLOPs, against the dense MLP, transformers'
     grouped_mm, Liger-Kernel's fused MoE and SonicMoE (absent: its wheels do not fit), and the activation memory
     each keeps for its backward;
  4. the main job, Llama (main_job.step_llama): SmolLM2-1.7B's layer shape, dense, then converted to 8 experts
     top-2, each trained with Trainer(bf16=True), then saved one file per expert;
  5. the main job, Qwen3-MoE (main_job.step_qwen3): Qwen3-30B-A3B's layer shape on experts_implementation "hf_moe"
     and "grouped_mm", and the dense Qwen3 of the same active FLOPs;
  6. decode (decode_bench.py): the saved MoE reloaded, its logits held against the saved model's, greedy decode with
     a static cache against the dense Llama.

Checkpoints go to --work (default: a temporary directory, removed at the end). DIR also gets backends_table.md: the
layer and main-job tables ready for docs/backends.md. `--smoke` runs the same steps on CPU tensors under
TRITON_INTERPRET=1 at tiny shapes (CI runs it, so the command cannot rot): what needs a GPU runs at a tiny scale and
says so, and the figures mean nothing. `--steps layers,qwen3` runs some of the steps (keys: environment,
correctness, layers, llama, qwen3, decode, and `training`, run only when named: first light's training step, where
each backend's gradients under bf16 autocast are held against the fp32 step's, for a run after a kernel changed).
Exit status 1 when a step failed (a Triton op that fell back to torch included).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import _versions
from .main_job import WORK_ENV
from .record import Report
from .runner import StepSpec, chosen_steps, run_steps

STEPS = [
    StepSpec("environment", "environment", "hf_moe.gpu_check.steps:step_environment", most=40, least=10),
    StepSpec("correctness", "correctness at real shapes", "hf_moe.gpu_check.correctness:step_correctness",
             most=100, least=60),
    StepSpec("layers", "layer speed and memory", "hf_moe.gpu_check.layer_bench:step_layers", most=130, least=60),
    StepSpec("llama", "main job: Llama dense and converted", "hf_moe.gpu_check.main_job:step_llama", most=100,
             least=50),
    StepSpec("qwen3", "main job: Qwen3-MoE", "hf_moe.gpu_check.main_job:step_qwen3", most=90, least=45),
    StepSpec("decode", "reload and decode", "hf_moe.gpu_check.decode_bench:step_decode", most=None, least=40),
]
# Run only when named in --steps (a kernel changed since first light): first light's training step, each backend's
# gradients under bf16 autocast held against the fp32 step's, and what HF_MOE_BACKEND=auto runs on this GPU.
OPTIONAL = [StepSpec("training", "training step against fp32",
                     "hf_moe.gpu_check.steps:step_training_and_expert_parallel", most=None, least=40)]
BUDGET = 440.0
# Under --smoke each step's limit is scaled: CPU, Triton's interpreter and 2 shared cores take longer than the GPU.
SMOKE_SCALE, SMOKE_BUDGET = 2.0, 900.0


def backends_table(results: dict) -> str:
    """The layer and main-job tables of a run's results.json, for docs/backends.md."""
    lines = [f"Run of {results.get('started', '?')}: {results.get('versions', '')}; {results.get('mode', '')}", ""]
    for step in results.get("steps", []):
        if step.get("data", {}).get("rows") or step.get("data", {}).get("results"):
            lines += [f"### {step['number']}. {step['name']}: {step['status']}", "", step.get("detail", "").strip(),
                      ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_moe.gpu_check.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_bench", help="where the report goes (default: gpu_bench)")
    parser.add_argument("--work", default=None, help="scratch directory for checkpoints (default: a temporary one, "
                                                     "removed at the end)")
    parser.add_argument("--smoke", action="store_true", help="CPU tensors, TRITON_INTERPRET=1, tiny shapes (CI)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole run (default {BUDGET:.0f}; {SMOKE_BUDGET:.0f} with --smoke)")
    parser.add_argument("--steps", default=None, help="comma-separated keys of the steps to run (default: all but "
                                                      "training): " + ", ".join(s.key for s in STEPS + OPTIONAL))
    args = parser.parse_args(argv)
    every = STEPS + OPTIONAL
    specs = chosen_steps(parser, args.steps, every, STEPS)
    budget = args.budget if args.budget is not None else (SMOKE_BUDGET if args.smoke else BUDGET)
    if not 0 < budget < math.inf:  # NaN too: a NaN limit never times out, and a hung step would stay
        parser.error(f"--budget must be a finite number of seconds above 0, got {args.budget!r}")
    least = sum(s.least for s in specs)
    if budget < least:
        parser.error(f"--budget {budget:.0f} is under the {least:.0f} s that the steps need at least ("
                     + ", ".join(f"{s.key} {s.least:.0f}" for s in specs) + "): give more, or fewer --steps")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_bench-"))
    env = {**os.environ, WORK_ENV: str(work.resolve())}
    env.setdefault("HF_MOE_BACKEND", "triton")  # what auto runs for bf16 on sm90; never builds the C++ extension
    env.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")  # its autotuner times ~240 configurations a shape (layer_bench)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    context = dict(mode="--smoke (CPU tensors, TRITON_INTERPRET=1, tiny shapes)" if args.smoke else "GPU",
                   started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), versions=_versions(), budget=f"{budget:.0f} s",
                   HF_MOE_BACKEND=env["HF_MOE_BACKEND"], LIGER_FUSED_MOE_AUTOTUNE=env["LIGER_FUSED_MOE_AUTOTUNE"])
    report = Report(Path(args.out), "hf_moe gpu_check bench", context)
    try:
        run_steps(specs, report, budget, args.smoke, env, SMOKE_SCALE if args.smoke else 1.0,
                  stop_after=lambda step: step.data.get("runnable") is False,
                  numbers=[every.index(spec) + 1 for spec in specs], fork=args.smoke)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
        results = json.loads((report.out / "results.json").read_text()) if (report.out / "results.json").is_file() \
            else {}
        (report.out / "backends_table.md").write_text(backends_table(results))
    return report.conclude("gpu_bench")


if __name__ == "__main__":
    sys.exit(main())
