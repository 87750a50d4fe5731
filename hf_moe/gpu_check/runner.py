"""Each gpu_check step in a child process of its own, with its own time limit, inside the run's budget.

    parent (runner.run_steps)                    child (`python -m hf_moe.gpu_check.child TARGET ...`)
      plans the step's limit from the budget       imports the step's function and runs it: fn(step, smoke, limit)
      starts the child in a new process group      flushes the Step to RESULT as it goes (record.Step.flush), and
      kills the group at the limit                 at the end, with the Triton ops that fell back to torch
      reads RESULT (what was flushed, if any)
      appends the child's output to logs.txt, rewrites report.md and results.json

A crash (a CUDA fault, a segfault, an abort), a hang or an exception costs only its own step: the step is recorded
as failed, with its exit status or "timed out", the output's tail and whatever it flushed, and the next step runs.
Nothing is built on the way: the children run with HF_MOE_BACKEND=triton (or what the caller set), which never
compiles the C++ CPU extension.

Under --smoke (CPU, and CI) the children are forked from a fork server (hf_moe/forkserver.py, started once with the
children's environment), which imported torch, transformers and triton: a fresh interpreter spends about 10 s of a
2-core machine importing them, more than most smoke steps then run. A forked child is otherwise the same: its own
session, output and working directory, killed with its group at its limit. On a GPU each step starts a fresh
interpreter, so that no step inherits another process's state.

Limits: the steps come in the order of their value; step i may take at most `most` seconds and no more than what
the budget has left less the `least` of every later step that has one (so each later step still gets its minimum);
a step whose limit falls under its own `least` is skipped, saying so. A step with no `most` takes what is left.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..forkserver import Child, ForkServer, Refused
from .record import FAILED, PASSED, RUNNING, SKIPPED, Report, Step, code_block

ROOT = Path(__file__).resolve().parents[2]  # a source checkout: tests/ beside hf_moe/


@dataclass(frozen=True)
class StepSpec:
    """A step: its key (for --steps), its name, the function a child runs ("module:function", called as
    fn(step, smoke, limit)), the most seconds it may take (None: what is left) and the least worth starting it
    with."""

    key: str
    name: str
    target: str
    most: float | None
    least: float


def chosen_steps(parser, keys: str | None, every: list[StepSpec], default: list[StepSpec]) -> list[StepSpec]:
    """The steps `--steps KEYS` names (comma-separated keys), in the order of `every`; `default` when KEYS is None or
    empty. An unknown key is `parser`'s error, which lists the steps."""
    wanted = [k.strip() for k in (keys or "").split(",") if k.strip()]
    if not wanted:
        return default
    unknown = sorted(set(wanted) - {s.key for s in every})
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}; the steps are {', '.join(s.key for s in every)}")
    return [s for s in every if s.key in wanted]


def plan_limit(specs: list[StepSpec], index: int, left: float, scale: float = 1.0) -> float:
    """Seconds step `index` may take with `left` seconds of budget: at most its `most` (x `scale`), leaving every later
    step that has a `most` its `least`."""
    reserve = sum(s.least for s in specs[index + 1:] if s.most is not None)
    most = specs[index].most
    return min(left - reserve, left if most is None else most * scale)


def run_steps(specs: list[StepSpec], report: Report, budget: float, smoke: bool, env: dict[str, str],
              scale: float = 1.0, stop_after=None, numbers: list[int] | None = None, fork: bool = False) -> Report:
    """Run each spec in a child within `budget` seconds, adding its Step to `report` (written after each).
    `stop_after(step)`: True to skip the remaining steps (said so in each). `numbers`: the steps' numbers in the
    report (default 1, 2, ...). `fork`: fork the children from a fork server (never where a step uses CUDA)."""
    if not 0 < budget < math.inf:  # (NaN too: a NaN limit would never time out, and a hung step would stay)
        raise ValueError(f"budget must be a finite number of seconds above 0, got {budget!r}.")
    deadline = time.monotonic() + budget
    stopped = ""
    (report.out / "logs.txt").write_text("")  # this run's output only
    servers = ForkServer(_preload(), env, cwd=str(ROOT)) if fork else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp, servers as server:
        for index, spec in enumerate(specs):
            number = numbers[index] if numbers else index + 1
            left = deadline - time.monotonic()
            limit = plan_limit(specs, index, left, scale)
            if stopped or limit < spec.least:
                why = stopped or (f"{max(left, 0):.0f} s of the {budget:g} s budget left, less what the later steps "
                                  f"need: {max(limit, 0):.0f} s for this step, which needs at least {spec.least:.0f}")
                step = Step(number, spec.name, SKIPPED, f"skipped: {why}")
            else:
                print(f"[gpu_check] step {number}: {spec.name} (limit {limit:.0f} s) ...", flush=True)
                step = run_child(spec, number, smoke, limit, env, Path(tmp), report.out / "logs.txt", server)
                print(f"[gpu_check] step {number}: {step.status} ({step.seconds:.0f} s): {step.summary}", flush=True)
            report.add(step)
            if not stopped and stop_after is not None and stop_after(step):
                stopped = f"step {number} ({spec.name}) says the others cannot run: {step.summary}"
    return report


def run_child(spec: StepSpec, number: int, smoke: bool, limit: float, env: dict[str, str], tmp: Path,
              log: Path, server: ForkServer | None = None) -> Step:
    """Run `spec` in a child process (its own process group), killed after `limit` seconds; its Step. With `server`,
    the child is forked from it (which has `env`) rather than a fresh interpreter."""
    result, output = tmp / f"step{number}.json", tmp / f"step{number}.log"
    argv = [spec.target, str(result), "--number", str(number), "--name", spec.name, "--limit", f"{limit:.1f}",
            "--deadline", f"{time.time() + limit:.1f}"] + (["--smoke"] if smoke else [])
    start = time.monotonic()
    with open(output, "w") as out:
        child = None
        if server is not None:
            with contextlib.suppress(Refused):  # (the server runs a thread: this step runs fresh)
                child = server.start({"module": "hf_moe.gpu_check.child", "args": argv, "output": str(output)})
        if child is None:
            child = subprocess.Popen([sys.executable, "-m", "hf_moe.gpu_check.child", *argv], stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=env,
                                     start_new_session=True)
        status = None
        try:
            status = child.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            pass
        finally:  # whatever the step started (pytest, torchrun, ...) goes with it
            if isinstance(child, Child):
                child.kill()  # (and the child itself, if it was killed before it made its own group)
            else:
                kill_group(child.pid)
            child.wait()
    seconds = time.monotonic() - start
    text = output.read_text(errors="replace")
    with open(log, "a") as logs:
        logs.write(f"==== step {number}: {spec.name} (exit status {status}, {seconds:.0f} s) ====\n{text}\n")
    step = Step.load(result) if result.is_file() else Step(number, spec.name, RUNNING)
    step.seconds, step.limit = seconds, limit
    if status is None:
        step.status = FAILED
        step.summary = f"timed out after {limit:.0f} s" + (f"; so far: {step.summary}" if step.summary else "")
    elif status != 0 or step.status == RUNNING:
        step.status = FAILED
        how = f"exit status {status}" + (f" (signal {_signal_name(-status)})" if status < 0 else "")
        step.summary = f"the step's process died: {how}" + (f"; so far: {step.summary}" if step.summary else "")
    if step.status != PASSED or not step.detail:
        step.detail += f"\n\nThe step's output (last lines):\n\n{code_block(text, 6000)}"
    return step


def _preload() -> list[str]:
    """What the fork server imports: torch, transformers' model code and triton where installed, and this package
    (not the child's module, which runs as `__main__`: imported before, runpy would warn that it runs twice)."""
    found = [f"import {name}" for name in ("torch", "transformers.modeling_utils", "triton")
             if importlib.util.find_spec(name.split(".")[0]) is not None]
    return [*found, "import hf_moe.gpu_check"]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def kill_group(pid: int) -> None:
    """SIGKILL the process group `pid` leads (a child started with start_new_session=True), if it is still there."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
