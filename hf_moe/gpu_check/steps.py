"""Steps 1, 4, 5 and 6 of gpu_check: the environment, the training step (the default's choice, EP x FSDP2), the Triton
tests on CUDA, and compute-sanitizer. Each runs in a child process (runner.py) as fn(step, smoke, limit)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .record import FAILED, PASSED, SKIPPED, Step, code_block, triton_fallbacks
from .runner import ROOT, kill_group

TRITON_TESTS = ROOT / "tests"
TRITON_FILES = "test_triton_*.py"  # the Triton test files, run as one set
# The tests are chosen by their pytest markers (pyproject.toml). On a GPU (`gpu`): every Triton test but the AOT
# compiles (a real GPU compiles for real) and the two that report the CPU backend (`backend_report()` under
# HF_MOE_BACKEND=auto builds the C++ extension, which nothing here runs; CI runs them). Under --smoke (the
# interpreter, CI; `gpu_smoke`): a few quick kernel tests, so the step's code runs. Under compute-sanitizer (slow;
# `memcheck`): the small kernel tests.
GPU_TESTS, SMOKE_TESTS, MEMCHECK_TESTS = "gpu", "gpu_smoke", "memcheck"
LAUNCHES_FILE = "HF_MOE_TRITON_LAUNCHES"  # the Triton test files write their launch counts and fallbacks there
MARGIN = 10.0  # seconds a step keeps, within its limit, to record what its own subprocess did


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str]:
    """(exit status or None on timeout, stdout + stderr) of `cmd`, in a process group killed whole on timeout."""
    with tempfile.TemporaryFile("w+") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            status = process.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            status = None
        kill_group(process.pid)  # what the command started goes with it
        process.wait()
        out.seek(0)
        text = out.read()
    return status, text + ("" if status is not None else f"\n(timed out after {timeout:.0f} s)")


def step_environment(step, smoke: bool, limit: float) -> None:
    """nvidia-smi, `python -m hf_moe.env`, and whether the Triton kernels can run here at all (data["runnable"])."""
    from ..env import report
    from ..ops.triton import status as triton_status

    smi = shutil.which("nvidia-smi")
    parts, data = [], {}
    if smi:
        status, out = _run([smi], min(30.0, limit / 3))
        parts.append(f"nvidia-smi:\n\n{code_block(out)}")
        data["nvidia_smi"] = out
    else:
        parts.append("nvidia-smi: skipped: not found" + (" (--smoke: no GPU)" if smoke else ""))
    env_out = report()
    parts.append(f"python -m hf_moe.env (HF_MOE_BACKEND={os.environ.get('HF_MOE_BACKEND', 'auto')}):\n\n"
                 f"{code_block(env_out)}")
    data.update(hf_moe_env=env_out, cuda=torch.cuda.is_available(), torch=torch.__version__)
    step.data, step.detail = data, "\n\n".join(parts)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    step.status, step.summary = PASSED, f"{gpu}; torch {torch.__version__}"
    usable, why = triton_status("cpu" if smoke else "cuda")
    if not usable:  # the other steps cannot run: the parent skips them, saying this
        step.status, step.summary = FAILED, why + ("" if smoke else " (or add --smoke to run the steps on CPU)")
    step.data["runnable"] = usable


def _triton_files() -> list[Path]:
    return sorted(TRITON_TESTS.glob(TRITON_FILES))


def _pytest(select: str, timeout: float, prefix: list[str] | None = None, env: dict | None = None, workers: int = 0):
    """(exit status, output, launches {kernel: count}, fell_back {op: error}) of the Triton tests marked `select` (a
    pytest -m expression), on `workers` pytest-xdist processes (0: in pytest's own process)."""
    with tempfile.TemporaryDirectory() as tmp:
        launches = Path(tmp) / "launches.json"
        cmd = [*(prefix or []), sys.executable, "-m", "pytest", *map(str, _triton_files()), "-v",
               "-p", "no:cacheprovider", "-m", select, *(["-n", str(workers)] if workers else [])]
        status, out = _run(cmd, timeout, {**(env or {}), LAUNCHES_FILE: str(launches)})
        counts, fell_back = launch_records(launches)
    return status, out, counts, fell_back


def launch_records(path: Path) -> tuple[dict[str, int], dict[str, str]]:
    """({kernel: launches}, {op: error}) that the Triton tests wrote to `path` or, on pytest-xdist workers, to
    `path`.gw0, `path`.gw1, ...: summed over the workers."""
    counts, fell_back = {}, {}
    for found in sorted(path.parent.glob(path.name + "*")):
        record = json.loads(found.read_text())
        for kernel, n in record.get("launches", {}).items():
            counts[kernel] = counts.get(kernel, 0) + n
        fell_back.update(record.get("fell_back", {}))
    return counts, fell_back


def xdist_workers(smoke: bool) -> int:
    """pytest-xdist processes for the kernel tests on a GPU, one per two cores, at most 8: in one process they take
    minutes (docs/backends.md; Triton compiles every kernel and autotune configuration on the host, which workers
    spread over its cores). 2 under --smoke (a few quick tests, on the workers' code path: their launch counts are
    summed as on a GPU). 0 without pytest-xdist."""
    if importlib.util.find_spec("xdist") is None:
        return 0
    return 2 if smoke else max(1, min(8, (os.cpu_count() or 2) // 2))


def _summary_line(out: str) -> str:
    """pytest's closing line, or (cut short) the tests it finished, counted from its -v lines."""
    lines = [line for line in out.splitlines() if line.startswith("=") and (" passed" in line or " failed" in line
                                                                             or " error" in line)]
    if lines:
        return lines[-1].strip("= ")
    counts = {word: sum(f" {word.upper()}" in line for line in out.splitlines() if "::" in line)
              for word in ("passed", "failed", "error", "skipped")}
    return "cut short; so far " + ", ".join(f"{n} {word}" for word, n in counts.items() if n) if any(
        counts.values()) else "no test finished"


def _finished_clean(out: str) -> bool:
    """Whether pytest printed its closing line with tests passed and none failed or in error (a run can be killed at
    its limit after that line, while its workers exit: docs/backends.md)."""
    closing = [line for line in out.splitlines() if line.startswith("=") and " in " in line and line.endswith("=")]
    if not closing:
        return False
    line = closing[-1]
    return " passed" in line and not any(word in line for word in (" failed", " error"))


def _no_triton_tests() -> str | None:
    """Why the Triton tests cannot run here (None if they can): they are files of hf_moe's source tree (tests/ beside
    hf_moe/), which an installed package (a wheel in site-packages) does not hold. The other steps need no source."""
    if _triton_files():
        return None
    return (f"skipped: the Triton tests are files of hf_moe's source tree, not of the installed package (no "
            f"{TRITON_TESTS / TRITON_FILES}). Run gpu_check from a source checkout, where tests/ sits beside hf_moe/: "
            "clone the hf_moe repository, `pip install -e .[dev]` in it, and run `python -m hf_moe.gpu_check` there")


def step_triton_tests(step, smoke: bool, limit: float) -> None:
    if _no_triton_tests():
        step.status, step.summary = SKIPPED, _no_triton_tests()
        return
    select = SMOKE_TESTS if smoke else GPU_TESTS
    env = {"HF_MOE_BACKEND": "triton"}
    workers = xdist_workers(smoke)
    status, out, launches, fell_back = _pytest(select, limit - MARGIN, env=env, workers=workers)
    processes = f"{workers} pytest-xdist workers" if workers else "one process"
    where = f"CPU tensors under TRITON_INTERPRET=1 (--smoke: a few quick tests), {processes}" if smoke else \
        f"CUDA, no interpreter, {processes}"
    step.fell_back.update(fell_back)
    step.data = dict(where=where, select=select, exit_status=status, launches=launches, output=out[-20000:])
    files = (TRITON_TESTS / TRITON_FILES).relative_to(ROOT)
    step.detail = f"{where}; `pytest {files} -m {select}`\n\n{code_block(out)}"
    finished = status is None and _finished_clean(out)  # killed while exiting, after pytest's closing line
    step.status = PASSED if (status == 0 or finished) and launches else FAILED
    ending = "" if status is not None else \
        "; killed at the step's limit while exiting, after pytest's closing line" if finished else "; timed out"
    step.summary = _summary_line(out) + ending + \
        ("" if launches or (status is None and not finished) else "; no Triton kernel launched")


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        candidate = Path(root) / "bin" / "compute-sanitizer"
        if root and candidate.is_file():
            return str(candidate)
    return None


def step_sanitizer(step, smoke: bool, limit: float) -> None:
    if smoke or not torch.cuda.is_available():
        step.status, step.summary = SKIPPED, "skipped: memcheck checks CUDA device memory; no GPU here"
        return
    tool = _sanitizer()
    if tool is None:
        step.status = SKIPPED
        step.summary = "skipped: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda)"
        return
    if _no_triton_tests():
        step.status, step.summary = SKIPPED, _no_triton_tests()
        return
    prefix = [tool, "--tool", "memcheck", "--error-exitcode", "1", "--target-processes", "all"]
    status, out, launches, fell_back = _pytest(MEMCHECK_TESTS, limit - MARGIN, prefix, env={"HF_MOE_BACKEND": "triton"})
    errors = [line for line in out.splitlines() if "ERROR SUMMARY" in line]
    step.fell_back.update(fell_back)
    step.data = dict(select=MEMCHECK_TESTS, exit_status=status, launches=launches, output=out[-20000:])
    step.detail = f"`compute-sanitizer --tool memcheck pytest -m {MEMCHECK_TESTS}`\n\n{code_block(out)}"
    step.status = PASSED if status == 0 else FAILED
    step.summary = (errors[-1].strip() if errors else "no ERROR SUMMARY line") + ("" if status is not None else
                                                                                  "; timed out")


def _tiny_model(device: torch.device, smoke: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..convert.api import convert_to_moe

    size = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4) if smoke else \
        dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16)
    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=512, num_hidden_layers=2, num_key_value_heads=4, **size))
    return convert_to_moe(dense.to(device), num_experts=8, top_k=2, noise=0.05).to(device).train()


# A gradient of the Triton run may be this much further from the fp32 reference than the torch backend's, under the
# same bf16 autocast: relative error <= FACTOR x torch's + FLOOR. Both backends round to bf16 where autocast does, and
# some gradients are that noisy for either, a router's most (upcycled experts are near-equal, so a router's gradient
# is a small difference of their outputs; the H100's errors are in docs/backends.md). A defect (a row, an expert or a
# scale lost) is far beyond.
GRAD_FACTOR, GRAD_FLOOR = 1.5, 5e-3


def compare_gradients(grads: dict, torch_grads: dict, reference: dict):
    """(Triton's errors, torch's errors, the parameter closest to its limit, a problem or "") of two bf16-autocast
    runs' gradients, Triton's and the torch backend's, each against the fp32 step's (`reference`): relative error
    (norm) per parameter; a problem where Triton's exceeds GRAD_FACTOR x torch's + GRAD_FLOOR."""
    from .correctness import rel_error

    errors = {n: rel_error(g, reference[n]) for n, g in grads.items()}
    torch_errors = {n: rel_error(torch_grads[n], reference[n]) for n in grads}
    excess = {n: errors[n] - (GRAD_FACTOR * torch_errors[n] + GRAD_FLOOR) for n in errors}
    worst = max(excess, key=excess.get)
    problem = "" if excess[worst] <= 0 else (
        f"gradient of {worst} off the fp32 step's by {errors[worst]:.2e} (the torch backend's: "
        f"{torch_errors[worst]:.2e}; at most {GRAD_FACTOR}x that + {GRAD_FLOOR})")
    return errors, torch_errors, worst, problem


def step_training(step, device: torch.device, smoke: bool) -> None:
    """A converted model's training step under bf16 autocast (fp32 weights: Trainer(bf16=True)), after
    `hf_moe.ops.warmup`, on the Triton backend and on the torch backend, each against the same step in fp32 without
    autocast (the torch backend): loss, every gradient, an AdamW step. Fails when the Triton run launched no Triton
    kernel or any op of it fell back to torch: it would compare torch against torch."""
    import copy

    from ..ops import use_backend, warmup
    from ..ops.triton.runtime import launch_counts
    from .correctness import rel_error

    model = _tiny_model(device, smoke)
    copies = {"torch": copy.deepcopy(model), "fp32": copy.deepcopy(model)}
    batch, length = (2, 8) if smoke else (4, 512)
    ids = torch.randint(3, 512, (batch, length), generator=torch.Generator().manual_seed(0)).to(device)
    results = {}
    for name, m, backend in (("triton", model, "triton"), ("torch", copies["torch"], "torch"),
                             ("fp32", copies["fp32"], "torch")):
        launched = sum(launch_counts.values())
        with use_backend(backend), torch.autocast(device.type, dtype=torch.bfloat16, enabled=name != "fp32"):
            lines = warmup(m, tokens=ids.numel()) if name == "triton" else []
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
        results[name] = (loss.detach().float(), grads, lines, sum(launch_counts.values()) - launched)
    torch.optim.AdamW(model.parameters(), lr=1e-4).step()
    (loss, grads, lines, launches), (want_loss, torch_grads, _, _) = results["triton"], results["torch"]
    fp32_loss, reference = results["fp32"][0], results["fp32"][1]
    errors, torch_errors, worst, gradient_problem = compare_gradients(grads, torch_grads, reference)
    finite = all(p.isfinite().all() for p in model.parameters())
    problems = []
    fell_back = triton_fallbacks()
    if fell_back or not launches:
        problems.append("the Triton run " + (f"fell back to torch in {', '.join(fell_back)}" if fell_back else
                                             "launched no Triton kernel") + ": torch was compared against torch")
    if abs(float(loss - want_loss)) > 1e-2 * abs(float(want_loss)):
        problems.append(f"loss {float(loss):.5f} vs torch backend {float(want_loss):.5f}")
    if gradient_problem:
        problems.append(gradient_problem)
    if not finite:
        problems.append("NaN or inf in the weights after the AdamW step")
    noisiest = max(torch_errors, key=torch_errors.get)
    step.data = dict(loss=float(loss), torch_loss=float(want_loss), fp32_loss=float(fp32_loss), worst_grad=worst,
                     worst_error=errors[worst], worst_torch_error=torch_errors[worst],
                     triton_vs_torch=max(rel_error(g, torch_grads[n]) for n, g in grads.items()),
                     grad_errors={n: [errors[n], torch_errors[n]] for n in errors}, warmup=lines,
                     triton_launches=launches)
    step.detail = (f"Converted Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, 8 experts, "
                   f"top-2), {batch}x{length} tokens, bf16 autocast over fp32 weights; warm-up:\n\n"
                   + code_block("\n".join(lines))
                   + f"\n\nloss {float(loss):.5f} (torch backend {float(want_loss):.5f}, fp32 without autocast "
                   f"{float(fp32_loss):.5f}). Gradients against the fp32 step's, relative error, Triton / torch "
                   f"backend: closest to the limit {errors[worst]:.2e} / {torch_errors[worst]:.2e} ({worst}); "
                   f"noisiest {errors[noisiest]:.2e} / {torch_errors[noisiest]:.2e} ({noisiest}). "
                   f"{launches} Triton kernel launches")
    step.status = FAILED if problems else PASSED
    step.summary = "; ".join(problems) if problems else \
        (f"loss and gradients as close to the fp32 step's as the torch backend's ({launches} Triton launches, no "
         "fallback); AdamW step finite")


def default_choice(step, smoke: bool, timeout: float) -> None:
    """What HF_MOE_BACKEND=auto runs on this GPU per dtype, executed in a child (default_choice.py), into `step`:
    the other steps force a backend, so this is where the default's own selection runs on a GPU."""
    if smoke:
        step.status, step.summary = SKIPPED, "skipped: --smoke has no GPU to choose for"
        return
    status, out = _run([sys.executable, "-m", "hf_moe.gpu_check.default_choice"], timeout, {"HF_MOE_BACKEND": "auto"})
    lines = [line for line in out.splitlines() if line.startswith("DEFAULT_CHOICE ")]
    result = json.loads(lines[-1][len("DEFAULT_CHOICE "):]) if lines else {}
    records = result.get("records", [])
    step.data = dict(exit_status=status, **result)
    step.detail = f"`HF_MOE_BACKEND=auto python -m hf_moe.gpu_check.default_choice`\n\n{code_block(out)}"
    if status == 0 and records:
        step.status = PASSED
        step.summary = ", ".join(f"{r['dtype']} -> {r['cuda_default']} ({r['triton_launches']} Triton launches)"
                                 for r in records)
    else:
        step.status = FAILED
        problems = [f"{r['dtype']}: {'; '.join(r['problems'])}" for r in records if r["problems"]]
        last = (out.strip().splitlines() or ["no output"])[-1]
        step.summary = "; ".join(problems) or f"exit status {status}: {last}"


def _part(step: Step, key: str, label: str, run) -> Step:
    """Run `run(part)` as a part of `step` named `label`: an exception is recorded in the part like any failure, its
    record goes to step.data[key], its detail is appended to the step's, and its failure fails the step. The part,
    for the caller's summary."""
    part = Step(step.number, label)
    try:
        run(part)
    except Exception as err:  # recorded in the part like any failure
        part.status, part.summary = FAILED, f"{type(err).__name__}: {err}"
    step.data[key] = dict(status=part.status, summary=part.summary, **part.data)
    said = part.summary if part.status == SKIPPED else f"{part.status}: {part.summary}"
    step.detail += f"\n\n{label}: {said}\n\n{part.detail}"
    if part.status == FAILED:
        step.status = FAILED
    return part


def step_training_and_expert_parallel(step, smoke: bool, limit: float) -> None:
    """Step 4: the training step, the CUDA default's choice, then the EP x FSDP2 step (skipped with fewer than 2
    GPUs), as one step."""
    start = time.monotonic()
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    step_training(step, device, smoke)
    step.flush()
    choice = _part(step, "default_backend", "The default backend (HF_MOE_BACKEND=auto)",
                   lambda part: default_choice(part, smoke, min(60.0, limit - (time.monotonic() - start) - MARGIN)))
    step.summary += f"; default backend: {choice.summary}"
    step.flush()
    ep = _part(step, "expert_parallel", "EP x FSDP2",
               lambda part: step_expert_parallel(part, smoke, limit - (time.monotonic() - start) - MARGIN))
    step.summary += f"; EP x FSDP2: {ep.summary if ep.status != PASSED else 'passed: ' + ep.summary}"


def step_expert_parallel(step, smoke: bool, timeout: float) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if smoke or count < 2:
        where = "--smoke runs on CPU" if smoke else f"{count} CUDA device(s)"
        step.status = SKIPPED
        step.summary = (f"skipped: EP x FSDP2 needs 2 or more CUDA devices ({where}); tests/test_distributed.py runs "
                        "it on CPU with gloo")
        return
    procs = min(count, 8)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}", "-m", "hf_moe.gpu_check.ep_step"]
    status, out = _run(cmd, timeout)
    ok = [line for line in out.splitlines() if line.startswith("EP_STEP ")]
    step.data = dict(processes=procs, exit_status=status, output=out[-20000:])
    step.detail = f"`torchrun --nproc-per-node={procs} -m hf_moe.gpu_check.ep_step`\n\n{code_block(out)}"
    step.status = PASSED if status == 0 and ok else FAILED
    step.summary = ok[-1][len("EP_STEP "):] if ok else f"exit status {status}"
