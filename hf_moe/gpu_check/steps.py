"""Steps 1, 2, 3 and 6 of gpu_check: the environment, the Triton tests on CUDA, compute-sanitizer, and training."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from .record import FAILED, PASSED, SKIPPED, code_block

ROOT = Path(__file__).resolve().parents[2]  # a source checkout: tests/ beside hf_moe/
TRITON_TESTS = ROOT / "tests" / "test_triton.py"
# On a GPU: every test of tests/test_triton.py but the AOT compiles (a real GPU compiles for real). Under --smoke
# (the interpreter, CI): a few quick kernel tests, so the step's code runs.
GPU_TESTS = "not compiles_for_sm90 and not aot_check"
SMOKE_TESTS = "test_sort_by_expert_with_gpu_blocks or test_no_tokens_at_all or " \
              "(test_grouped_mm_forward_and_dx and dropped)"
# Under compute-sanitizer (slow): the small kernel tests.
MEMCHECK_TESTS = "test_sort_by_expert_with_gpu_blocks or (test_permute_and_unpermute and dropped) or " \
                 "(test_grouped_mm_forward_and_dx and dropped) or (test_grouped_mm_weight_grad and dropped) or " \
                 "(test_activation_forward_and_backward and silu)"


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str]:
    """(exit status or None on timeout, stdout + stderr)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), cwd=ROOT,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        return None, out + f"\n(timed out after {timeout:.0f} s)"
    return done.returncode, done.stdout + done.stderr


def step_environment(step, smoke: bool) -> None:
    smi = shutil.which("nvidia-smi")
    parts, data = [], {}
    if smi:
        status, out = _run([smi], 60)
        parts.append(f"nvidia-smi:\n\n{code_block(out)}")
        data["nvidia_smi"] = out
    else:
        parts.append("nvidia-smi: skipped: not found" + (" (--smoke: no GPU)" if smoke else ""))
    status, env_out = _run([sys.executable, "-m", "hf_moe.env"], 300)
    parts.append(f"python -m hf_moe.env:\n\n{code_block(env_out)}")
    data["hf_moe_env"] = env_out
    step.data, step.detail = data, "\n\n".join(parts)
    step.status = PASSED if status == 0 else FAILED
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    step.summary = f"{gpu}; torch {torch.__version__}" + ("" if status == 0 else "; python -m hf_moe.env failed")


def _pytest(select: str, timeout: float, prefix: list[str] | None = None, env: dict | None = None):
    cmd = [*(prefix or []), sys.executable, "-m", "pytest", str(TRITON_TESTS), "-q", "-p", "no:cacheprovider",
           "-k", select]
    return _run(cmd, timeout, env)


def step_triton_tests(step, smoke: bool, timeout: float) -> None:
    if not TRITON_TESTS.is_file():
        step.status, step.summary = SKIPPED, f"skipped: {TRITON_TESTS} not found (run from a source checkout)"
        return
    select = SMOKE_TESTS if smoke else GPU_TESTS
    env = {"HF_MOE_BACKEND": "triton"}
    if not smoke:
        env["TRITON_INTERPRET"] = "0"
    status, out = _pytest(select, timeout, env=env)
    where = "CPU tensors under TRITON_INTERPRET=1 (--smoke: a few quick tests)" if smoke else "CUDA, no interpreter"
    tail = [line for line in out.splitlines() if " passed" in line or " failed" in line or "error" in line.lower()]
    step.data = dict(where=where, select=select, exit_status=status, output=out[-20000:])
    step.detail = f"{where}; `pytest {TRITON_TESTS.relative_to(ROOT)} -k \"{select}\"`\n\n{code_block(out)}"
    step.status = PASSED if status == 0 else FAILED
    step.summary = (tail[-1].strip("= ") if tail else "no summary line") + ("" if status is not None else "; timed out")


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        candidate = Path(root) / "bin" / "compute-sanitizer"
        if root and candidate.is_file():
            return str(candidate)
    return None


def step_sanitizer(step, smoke: bool, timeout: float) -> None:
    if smoke or not torch.cuda.is_available():
        step.status, step.summary = SKIPPED, "skipped: memcheck checks CUDA device memory; no GPU here"
        return
    tool = _sanitizer()
    if tool is None:
        step.status = SKIPPED
        step.summary = "skipped: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda)"
        return
    if not TRITON_TESTS.is_file():
        step.status, step.summary = SKIPPED, f"skipped: {TRITON_TESTS} not found (run from a source checkout)"
        return
    prefix = [tool, "--tool", "memcheck", "--error-exitcode", "1", "--target-processes", "all"]
    status, out = _pytest(MEMCHECK_TESTS, timeout, prefix, env={"HF_MOE_BACKEND": "triton", "TRITON_INTERPRET": "0"})
    errors = [line for line in out.splitlines() if "ERROR SUMMARY" in line]
    step.data = dict(select=MEMCHECK_TESTS, exit_status=status, output=out[-20000:])
    step.detail = f"`compute-sanitizer --tool memcheck pytest -k \"{MEMCHECK_TESTS}\"`\n\n{code_block(out)}"
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
    return convert_to_moe(dense, num_experts=8, top_k=2, noise=0.05).to(device).train()


def step_training(step, device: torch.device, smoke: bool) -> None:
    """A converted model's training step under bf16 autocast (fp32 weights: Trainer(bf16=True)), after
    `hf_moe.ops.warmup`, on the Triton backend against the torch backend: loss, every gradient, an AdamW step."""
    import copy

    from ..ops import use_backend, warmup
    from .correctness import rel_error

    model = _tiny_model(device, smoke)
    twin = copy.deepcopy(model)
    batch, length = (2, 8) if smoke else (4, 512)
    ids = torch.randint(3, 512, (batch, length), generator=torch.Generator().manual_seed(0)).to(device)
    results = {}
    for name, m in (("triton", model), ("torch", twin)):
        with use_backend(name), torch.autocast(device.type, dtype=torch.bfloat16):
            lines = warmup(m, tokens=ids.numel())
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
        torch.optim.AdamW(m.parameters(), lr=1e-4).step()
        results[name] = (loss.detach().float(), grads, lines)
    (loss, grads, lines), (want_loss, want_grads, _) = results["triton"], results["torch"]
    errors = {n: rel_error(g, want_grads[n]) for n, g in grads.items()}
    worst = max(errors, key=errors.get)
    finite = all(p.isfinite().all() for p in model.parameters())
    problems = []
    if abs(float(loss - want_loss)) > 1e-2 * abs(float(want_loss)):
        problems.append(f"loss {float(loss):.5f} vs torch backend {float(want_loss):.5f}")
    if errors[worst] > 5e-2:
        problems.append(f"gradient of {worst} off by {errors[worst]:.2e}")
    if not finite:
        problems.append("NaN or inf in the weights after the AdamW step")
    step.data = dict(loss=float(loss), torch_loss=float(want_loss), worst_grad=worst, worst_error=errors[worst],
                     warmup=lines)
    step.detail = (f"Converted Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, 8 experts, "
                   f"top-2), {batch}x{length} tokens, bf16 autocast over fp32 weights; warm-up:\n\n"
                   + code_block("\n".join(lines))
                   + f"\n\nloss {float(loss):.5f} (torch backend {float(want_loss):.5f}); "
                   f"largest gradient error {errors[worst]:.2e} ({worst})")
    step.status = FAILED if problems else PASSED
    step.summary = "; ".join(problems) if problems else "loss and gradients match the torch backend; AdamW step finite"


def step_training_and_expert_parallel(step, device: torch.device, smoke: bool, timeout: float) -> None:
    """Step 6: the training step, then the EP x FSDP2 step (skipped with fewer than 2 GPUs), as one step."""
    step_training(step, device, smoke)
    ep = type(step)(6, "EP x FSDP2")
    try:
        step_expert_parallel(ep, smoke, timeout)
    except Exception as err:  # recorded in the step like any failure
        ep.status, ep.summary = FAILED, f"{type(err).__name__}: {err}"
    step.data["expert_parallel"] = dict(status=ep.status, summary=ep.summary, **ep.data)
    step.detail += f"\n\nEP x FSDP2: {ep.status}: {ep.summary}\n\n{ep.detail}"
    step.summary += f"; EP x FSDP2: {ep.summary if ep.status != PASSED else 'passed: ' + ep.summary}"
    if ep.status == FAILED:
        step.status = FAILED


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
