"""`python -m hf_moe.env`: the environment, which code runs by default on CUDA and why, and which implementation each
MoE op uses and why."""

from __future__ import annotations

import platform
import shutil
import subprocess


def _tool_version(cmd: list[str], line: int = -1) -> str:
    if shutil.which(cmd[0]) is None:
        return "not found"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"error ({err})"
    lines = [line for line in out.splitlines() if line.strip()]
    return lines[line].strip() if lines else "unknown"


def _triton() -> str:
    """triton's version, and whether its kernels run on this machine's CUDA device and on CPU tensors, and why."""
    from hf_moe.ops import triton as triton_ops

    if triton_ops.version() is None:
        return "not installed (pip install triton; CUDA builds of torch bring it)"
    cuda, why_cuda = triton_ops.status("cuda")
    cpu, why_cpu = triton_ops.status("cpu")
    return (f"{triton_ops.version()}; on CUDA: {'runs' if cuda else 'does not run'} ({why_cuda}); "
            f"on CPU: {'interpreted' if cpu else 'no'} ({why_cpu})")


def _cuda_default(choice: tuple[str, str]) -> str:
    backend, why = choice
    code = "torch ops (torch.nn.functional.grouped_mm for bf16 GEMMs on sm90)" if backend == "torch" else \
        "hf_moe's Triton kernels"
    return f"{code}; {why}"


def report() -> str:
    import torch
    import transformers

    from hf_moe.ops import backend_report, cuda_default
    from hf_moe.version import __version__

    cuda = torch.cuda.is_available()
    lines = [
        f"hf_moe        {__version__}",
        f"python        {platform.python_version()} ({platform.machine()})",
        f"torch         {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}, "
        f"threads: {torch.get_num_threads()})",
        f"transformers  {transformers.__version__}",
        f"GPU           {torch.cuda.get_device_name(0) if cuda else 'none'}",
        f"triton        {_triton()}",
        f"c++           {_tool_version(['c++', '--version'], line=0)}",
        "",
        f"default on CUDA: {_cuda_default(cuda_default())}",
        "",
        f"{'op':<24} {'implementation':<55} why",
    ]
    for op, (impl, why) in backend_report().items():
        lines.append(f"{op:<24} {impl:<55} {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
