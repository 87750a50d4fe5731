"""`python -m hf_moe.gpu_check --smoke`: every step of the GPU first-light check, on CPU tensors under Triton's
interpreter at tiny shapes, each in a child process of its own, writing report.md, results.json and logs.txt; the
steps that need a GPU say why they are skipped. On a GPU the same command (without --smoke) is the real check
(scripts/first_light.sh). Also: a crash, a hang or an exception costs only its step, within the budget; a Triton op
that falls back to torch fails the run, and is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_moe.compat import triton_interpreter_problem
from hf_moe.gpu_check import STEPS as SPECS
from hf_moe.gpu_check.record import Report
from hf_moe.gpu_check.runner import StepSpec, plan_limit, run_steps

ROOT = Path(__file__).resolve().parents[1]
interpreter = pytest.mark.skipif(triton_interpreter_problem() is not None, reason=str(triton_interpreter_problem()))
STEPS = ["environment", "correctness at real shapes", "speed at 16k tokens, bf16", "training step, and EP x FSDP2",
         "tests/test_triton_*.py", "compute-sanitizer memcheck"]


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_MOE_BACKEND")}
    return {**env, **extra}


@pytest.mark.subprocess
@pytest.mark.gpu_versions
@pytest.mark.slow
@interpreter
def test_gpu_check_smoke_writes_its_report(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hf_moe.gpu_check", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.txt", "report.md", "results.json"]
    results = json.loads((tmp_path / "results.json").read_text())
    steps = {s["name"]: s for s in results["steps"]}
    assert [s["name"] for s in results["steps"]] == STEPS and results["passed"]
    status = {name: s["status"] for name, s in steps.items()}
    assert status == {**{name: "passed" for name in STEPS}, "compute-sanitizer memcheck": "skipped"}, status
    assert all(0 < s["seconds"] <= s["limit"] for s in results["steps"]) and not any(
        s["fell_back"] for s in results["steps"])
    assert steps["compute-sanitizer memcheck"]["summary"].startswith("skipped: ")
    kernel_tests = steps["tests/test_triton_*.py"]["data"]
    assert "TRITON_INTERPRET=1" in kernel_tests["where"] and "2 pytest-xdist workers" in kernel_tests["where"]
    # On a GPU the Triton tests took minutes in one process (docs/backends.md): they run on pytest-xdist workers, here
    # too, each writing its own launch counts, which gpu_check sums: the kernels ran, and gpu_check saw it.
    assert "[gw0]" in kernel_tests["output"] and "[gw1]" in kernel_tests["output"] and kernel_tests["launches"]
    correctness = steps["correctness at real shapes"]["data"]
    assert len(correctness["cases"]) == 6 and correctness["large_tensor"]["status"] == "passed"
    assert all(case["launches"] > 0 and not case["fell_back"] for case in correctness["cases"])
    assert not correctness["large_tensor"]["past_2_31"]  # tiny, and the report says so
    rows = steps["speed at 16k tokens, bf16"]["data"]["rows"]
    assert {row["impl"] for row in rows} == {"hf_moe triton", "hf_moe torch", "hf grouped_mm", "dense"}
    assert all(row["triton_ran"] for row in rows if row["impl"] == "hf_moe triton")
    training = steps["training step, and EP x FSDP2"]["data"]
    assert training["triton_launches"] > 0
    assert training["expert_parallel"]["status"] == "skipped" and "2 or more CUDA devices" in \
        training["expert_parallel"]["summary"]
    report = (tmp_path / "report.md").read_text()
    positions = [report.index(f"## {i}. {name}") for i, name in enumerate(STEPS, 1)]
    assert positions == sorted(positions)
    assert "the same code at a tiny size" in report and "times mean nothing" in report
    assert "verdict: passed" in report
    logs = (tmp_path / "logs.txt").read_text()
    assert all(f"==== step {i}: {name}" in logs for i, name in enumerate(STEPS, 1))
    assert "found in sys.modules" not in logs  # runpy's warning, once in every step's output on a GPU


# A Triton GEMM that fails to compile (as a config the GPU cannot hold would), in every process of the run.
FAILING_GEMM = """
from triton.runtime.errors import OutOfResources

import hf_moe.ops.triton.grouped_gemm as gemm


def _launch(*args, **kwargs):
    raise OutOfResources(294912, 232448, "shared memory")


gemm.launch = _launch
"""


@pytest.mark.subprocess
@pytest.mark.slow
@interpreter
def test_a_triton_op_that_falls_back_to_torch_fails_the_run_and_is_named(tmp_path):
    """With every Triton GEMM failing (the ops fall back to torch, as `_guarded` makes them): gpu_check exits 1,
    report.md names each op that fell back and its error, no row of the speed table is labelled Triton, and the
    training step does not pass torch against torch. On ffb5e1a every step passed."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FAILING_GEMM)
    out = tmp_path / "out"
    env = _env(PYTHONPATH=os.pathsep.join([str(inject), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "hf_moe.gpu_check", "--smoke", "--steps", "speed,training",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1, done.stdout[-6000:] + done.stderr[-4000:]
    assert "Triton op grouped_mm fell back to torch" in done.stdout
    results = json.loads((out / "results.json").read_text())
    assert [s["status"] for s in results["steps"]] == ["failed", "failed"] and not results["passed"]
    for step in results["steps"]:
        assert set(step["fell_back"]) >= {"grouped_mm"}, step["fell_back"]
        assert "OutOfResources" in step["fell_back"]["grouped_mm"]
    speed, training = results["steps"]
    triton_rows = [row for row in speed["data"]["rows"] if row["triton_ran"] is not None]
    assert triton_rows and all(not row["triton_ran"] and row["impl"].startswith("NOT hf_moe triton: ")
                               and "grouped_mm" in row["impl"] for row in triton_rows)
    assert not any(row["impl"] == "hf_moe triton" for row in speed["data"]["rows"])
    assert "torch was compared against torch" in training["summary"]
    report = (out / "report.md").read_text()
    assert "## Triton ops that fell back to torch" in report and "verdict: FAILED" in report
    assert "`grouped_mm`: OutOfResources" in report


# -- the runner: each step a child process with its own limit ---------------------------------------------------------
def fake_passes(step, smoke, limit):
    step.status, step.summary, step.data = "passed", "fine", dict(limit=limit, smoke=smoke, parent=os.getppid())


def fake_crashes(step, smoke, limit):
    step.data["before the crash"] = True
    step.flush()
    os.abort()


def fake_hangs(step, smoke, limit):
    pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid
    step.summary, step.data = "1 of 2 cases done", dict(grandchild=pid)
    step.flush()
    time.sleep(600)


def fake_raises(step, smoke, limit):
    raise ValueError("a step's own error")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat")
    return not (state.is_file() and state.read_text().split()[2] == "Z")


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("fork", [False, True], ids=["fresh", "forked"])
def test_a_crash_a_hang_or_an_error_costs_only_its_step(tmp_path, fork):
    """Five fake steps in child processes (fresh interpreters, or forked from the fork server as under --smoke): a hang
    is killed at its limit with whatever it started (its partial record kept), a crash (SIGABRT) and an exception fail
    their step only, the steps after them run, and a step the budget cannot give its minimum is skipped, saying so.
    The whole run stays inside the budget."""
    module = "test_gpu_check"
    hang = 10 if fork else 20  # a fresh child first spends seconds importing
    specs = [StepSpec("hangs", "hangs", f"{module}:fake_hangs", most=hang, least=1),
             StepSpec("crashes", "crashes", f"{module}:fake_crashes", most=60, least=1),
             StepSpec("raises", "raises", f"{module}:fake_raises", most=60, least=1),
             StepSpec("passes", "passes", f"{module}:fake_passes", most=60, least=1),
             StepSpec("too-big", "needs more than is left", f"{module}:fake_passes", most=None, least=10_000)]
    env = _env(PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    report = Report(tmp_path, "fake", {})
    start = time.monotonic()
    run_steps(specs, report, budget=240, smoke=True, env=env, fork=fork)
    assert time.monotonic() - start < 240
    hangs, crashes, raises, passes, too_big = report.steps
    assert hangs.status == "failed" and hangs.summary == f"timed out after {hang} s; so far: 1 of 2 cases done"
    assert not _alive(hangs.data["grandchild"])  # the step's own subprocess went with it
    assert crashes.status == "failed" and "died: exit status -6 (signal SIGABRT)" in crashes.summary
    assert crashes.data == {"before the crash": True}
    assert raises.status == "failed" and raises.summary == "ValueError: a step's own error"
    assert "Traceback" in raises.detail
    assert passes.status == "passed" and passes.data["smoke"] is True
    assert (passes.data["parent"] == os.getpid()) is not fork  # a forked child's parent is the fork server
    assert passes.limit - 30 < passes.data["limit"] < passes.limit  # less the child's start
    assert too_big.status == "skipped" and "needs at least 10000" in too_big.summary
    written = json.loads((tmp_path / "results.json").read_text())
    assert [s["status"] for s in written["steps"]] == ["failed", "failed", "failed", "passed", "skipped"]
    assert "==== step 2: crashes" in (tmp_path / "logs.txt").read_text()


@pytest.mark.oldest
def test_the_budget_goes_to_the_steps_in_order_of_value():
    """Each step gets at most its `most`, and leaves every later step its `least`; the last (compute-sanitizer)
    takes what is left; the default plan fits 420 s with every step's minimum."""
    assert [s.key for s in SPECS] == ["environment", "correctness", "speed", "training", "triton-tests", "sanitizer"]
    assert sum(s.least for s in SPECS) <= 420
    assert plan_limit(SPECS, 0, 420) == 60
    assert plan_limit(SPECS, 1, 400) == 150  # its most
    assert plan_limit(SPECS, 1, 200) == 200 - (45 + 40 + 40)  # what the later steps' minimums leave
    assert plan_limit(SPECS, 5, 37) == 37  # the sanitizer: what is left


@pytest.mark.oldest
def test_a_step_gets_what_is_left_of_its_limit_after_the_child_starts(tmp_path):
    """On the H100 the kernel tests' step timed out with nothing recorded: the step planned its pytest
    run for its whole limit, but its process had spent part of it starting (importing torch, cold). The child now
    hands the step what is left until the parent's deadline."""
    from hf_moe.gpu_check.child import child_main

    result = tmp_path / "step.json"
    child_main(["test_gpu_check:fake_passes", str(result), "--limit", "100", "--deadline", str(time.time() + 5)])
    data = json.loads(result.read_text())["data"]
    assert 0 < data["limit"] <= 5


@pytest.mark.oldest
def test_a_budget_under_the_steps_minimum_is_refused(capsys):
    """With `--budget 60` the plan skipped the environment step (which decides whether any step can run here) and
    ran the kernel tests; now such a budget is an error that names what the steps need."""
    from hf_moe.gpu_check import main

    with pytest.raises(SystemExit) as raised:
        main(["--budget", "60", "--out", "unused"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert "--budget 60 is under the 225 s that the steps need at least" in err and "environment 10" in err
    assert not Path("unused").exists()


@pytest.mark.oldest
def test_launch_counts_are_summed_over_the_workers(tmp_path):
    from hf_moe.gpu_check.steps import launch_records

    path = tmp_path / "launches.json"
    assert launch_records(path) == ({}, {})  # nothing written: no kernel ran
    (tmp_path / "launches.json.gw0").write_text(json.dumps({"launches": {"a": 2, "b": 1}, "fell_back": {}}))
    (tmp_path / "launches.json.gw1").write_text(json.dumps({"launches": {"a": 3}, "fell_back": {"permute": "err"}}))
    (tmp_path / "other.json").write_text("not ours")
    assert launch_records(path) == ({"a": 5, "b": 1}, {"permute": "err"})


@pytest.mark.oldest
def test_training_gradients_are_held_against_the_fp32_step():
    """Step 4 compared the Triton backend's bf16-autocast gradients with the torch backend's, which are as noisy: on
    the H100 a router's gradient differed between the two enough to fail the step (docs/backends.md). Each is now
    held against the fp32 step's: noise the torch backend has too passes, a lost expert's gradient still fails."""
    import torch

    from hf_moe.gpu_check.correctness import rel_error
    from hf_moe.gpu_check.steps import compare_gradients

    g = torch.Generator().manual_seed(0)
    reference = {"gate.weight": torch.randn(8, 64, generator=g), "experts": torch.randn(8, 96, 64, generator=g)}

    def noisy(scale):  # bf16-like rounding noise of relative size `scale`, independent per run
        return {n: r * (1 + scale * torch.randn(r.shape, generator=g)) for n, r in reference.items()}

    torch_grads, grads = noisy(0.05), noisy(0.05)
    assert rel_error(grads["gate.weight"], torch_grads["gate.weight"]) > 5e-2  # the old check failed this
    errors, torch_errors, _, problem = compare_gradients(grads, torch_grads, reference)
    assert problem == "" and all(0.03 < e < 0.07 for e in (*errors.values(), *torch_errors.values()))
    lost = dict(grads, experts=grads["experts"].clone())
    lost["experts"][3] = 0  # one expert's gradient lost
    _, _, worst, problem = compare_gradients(lost, torch_grads, reference)
    assert worst == "experts" and problem.startswith("gradient of experts off the fp32 step's by ")


# -- scripts/first_light.sh: the one command on a lent GPU -----------------------------------------------------------
def _first_light(out: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "first_light.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=_env(OUT=str(out), PYTHON=sys.executable, **env))


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


@pytest.mark.subprocess
@pytest.mark.gpu_versions
@pytest.mark.slow
def test_first_light_without_a_gpu_says_so_and_stops(tmp_path):
    """On a machine without a GPU the environment step says so (and how to run the steps on CPU), the other steps are
    skipped saying why, the exit status is 1, and $OUT holds the four files the device tool brings back."""
    out = tmp_path / "out"
    done = _first_light(out)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    assert _files(out) == ["first_light.log", "logs.txt", "report.md", "results.json"]
    results = json.loads((out / "results.json").read_text())
    environment, *others = results["steps"]
    assert environment["status"] == "failed" and "no CUDA device is visible" in environment["summary"]
    assert "--smoke" in environment["summary"]
    assert [s["status"] for s in others] == ["skipped"] * 5
    assert all("step 1 (environment) says the others cannot run" in s["summary"] for s in others)
    log = (out / "first_light.log").read_text()
    assert "torch " in log.splitlines()[1] and "| 1. environment | failed |" in log  # the versions, the table


@pytest.mark.subprocess
@pytest.mark.oldest
def test_first_light_when_hf_moe_does_not_import(tmp_path):
    """If `import hf_moe` fails (as it did on torch 2.11 at ffb5e1a), report.md still says so, with the traceback."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('a torch that cannot be imported (simulated)')\n")
    out = tmp_path / "out"
    done = _first_light(out, PYTHONPATH=str(tmp_path / "fake"))
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    assert _files(out) == ["first_light.log", "report.md"]
    report = (out / "report.md").read_text()
    assert "`import hf_moe` failed" in report and "a torch that cannot be imported (simulated)" in report


def test_a_cut_short_pytest_run_still_counts_what_it_finished():
    from hf_moe.gpu_check.steps import _summary_line

    done = "tests/test_triton.py::test_a PASSED [ 50%]\n=========== 1 passed, 1 failed in 3.2s ===========\n"
    assert _summary_line(done) == "1 passed, 1 failed in 3.2s"
    cut = "tests/test_triton.py::test_a PASSED [ 10%]\ntests/test_triton.py::test_b[x] FAILED [ 20%]\n(timed out)"
    assert _summary_line(cut) == "cut short; so far 1 passed, 1 failed"
    assert _summary_line("collecting ...") == "no test finished"


@pytest.mark.oldest
@pytest.mark.parametrize("closing, passed", [("84 passed, 3 skipped in 140.69s (0:02:20)", True),
                                             ("83 passed, 1 failed in 140.69s (0:02:20)", False), (None, False)])
def test_a_run_killed_after_pytest_closing_line_counts_what_it_printed(monkeypatch, closing, passed):
    """On the H100 (docs/backends.md) every kernel test passed, and pytest printed its closing line, but its
    workers were still exiting when the step's limit came: the step said "timed out" and failed. Killed after a
    closing line with no failure, the step passes and says how it ended; before it, or after a failure, it fails."""
    from hf_moe.gpu_check import steps
    from hf_moe.gpu_check.record import Step

    out = "[gw0] [100%] PASSED tests/test_triton.py::test_a\n"
    if closing:
        out += f"================== {closing} ===================\n"
    monkeypatch.setattr(steps, "_pytest", lambda *a, **kw: (None, out + "\n(timed out after 160 s)",
                                                            {"_grouped_mm_kernel": 3}, {}))
    step = Step(5, "tests/test_triton.py")
    steps.step_triton_tests(step, smoke=False, limit=180)
    assert (step.status == "passed") == passed, step.summary
    if passed:
        assert step.summary == (f"{closing}; killed at the step's limit while exiting, after pytest's closing line")
    else:
        assert "timed out" in step.summary


@pytest.mark.oldest
def test_the_default_backends_choice_is_executed_and_held_to_what_it_names(monkeypatch):
    """Step 4's check of HF_MOE_BACKEND=auto (default_choice.py), on CPU: the backend `cuda_default` names must be the
    one `dispatch_ops` picks and the one that runs (Triton launches or none), with the forced backend's output. Here
    HF_MOE_BACKEND=torch names torch and runs it; a `cuda_default` that names Triton while torch runs is caught."""
    import contextlib

    import torch

    import hf_moe.ops as ops
    import hf_moe.ops.backend as backend
    from hf_moe.gpu_check import default_choice

    monkeypatch.setenv("HF_MOE_BACKEND", "torch")
    monkeypatch.setattr(backend, "_chosen", {})
    monkeypatch.setattr(backend, "_variants", {})
    record = default_choice.check(torch.float32, torch.device("cpu"))
    assert record["ok"], record
    assert (record["cuda_default"], record["dispatch_ops"], record["triton_launches"]) == ("torch", "torch", 0)
    assert record["output_error"] == 0 and record["dx_error"] == 0
    monkeypatch.setattr(backend, "cuda_default", lambda device=None, dtype=None: ("triton", "faked"))
    monkeypatch.setattr(ops, "use_backend", lambda name: contextlib.nullcontext())  # the torch run stands in
    record = default_choice.check(torch.float32, torch.device("cpu"))
    assert not record["ok"]
    assert record["problems"][:2] == ["dispatch_ops picked torch, cuda_default names triton",
                                      "0 Triton launches under a default of triton"]
