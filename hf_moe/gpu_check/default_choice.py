"""The CUDA default, executed: what HF_MOE_BACKEND=auto runs for experts on this GPU, per dtype.

The other steps force a backend (HF_MOE_BACKEND=triton, `use_backend`), so without this the default's own selection
(`backend.cuda_default`, reached through `dispatch_ops` with the experts' dtype) would never run on a GPU. Step 4 runs
this module in a child with HF_MOE_BACKEND=auto. For bf16 and fp32 experts on cuda:0 it records:
  * the backend `cuda_default` names and the one `dispatch_ops` picked (they must agree);
  * the Triton kernel launches of a `SparseMoeBlock` forward and backward under the default (some where the default
    is Triton, none where it is torch);
  * the output and the input's gradient against the same block with that backend forced: relative Frobenius error
    (the same kernels on the same data: 0 expected, tiny where a kernel sums with atomics).

    HF_MOE_BACKEND=auto python -m hf_moe.gpu_check.default_choice     # prints one line: DEFAULT_CHOICE {json}
"""

from __future__ import annotations

import json
import sys

import torch

SAME = 1e-3  # relative error allowed between the default's run and the forced backend's (same kernels)


def _block(dtype: torch.dtype, device: torch.device):
    from transformers import LlamaConfig

    from ..configuration import MoEConfig
    from ..layers import SparseMoeBlock

    base = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4)
    config = MoEConfig.from_base(base, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512)
    torch.manual_seed(0)
    return SparseMoeBlock(config).to(device=device, dtype=dtype)


def _run(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, dX) of one forward and backward: x [B, T, H]."""
    x = x.detach().clone().requires_grad_(True)
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    block.zero_grad(set_to_none=True)
    return out.detach(), x.grad.detach()


def check(dtype: torch.dtype, device: torch.device) -> dict:
    """One dtype's record (see the module docstring); `ok` says whether it holds."""
    from ..ops import dispatch_ops, use_backend
    from ..ops.backend import cuda_default
    from ..ops.triton.runtime import launch_counts
    from .correctness import rel_error

    named, why = cuda_default(device, dtype)
    picked = dispatch_ops(device, "silu", dtype).name
    block = _block(dtype, device)
    x = torch.randn(4, 256, 256, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    before = sum(launch_counts.values())
    out, dx = _run(block, x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    launches = sum(launch_counts.values()) - before
    with use_backend(named):
        want_out, want_dx = _run(block, x)
    record = dict(dtype=str(dtype).removeprefix("torch."), cuda_default=named, why=why, dispatch_ops=picked,
                  triton_launches=launches, output_error=rel_error(out, want_out), dx_error=rel_error(dx, want_dx))
    problems = []
    if picked != named:
        problems.append(f"dispatch_ops picked {picked}, cuda_default names {named}")
    if (named == "triton") != (launches > 0):
        problems.append(f"{launches} Triton launches under a default of {named}")
    if max(record["output_error"], record["dx_error"]) > SAME:
        problems.append(f"output / dX {record['output_error']:.1e} / {record['dx_error']:.1e} off the forced "
                        f"{named} backend's")
    record["ok"], record["problems"] = not problems, problems
    return record


def main() -> int:
    if not torch.cuda.is_available():
        print("DEFAULT_CHOICE " + json.dumps(dict(skipped="no CUDA device")))
        return 0
    device = torch.device("cuda", 0)
    records = [check(dtype, device) for dtype in (torch.bfloat16, torch.float32)]
    print("DEFAULT_CHOICE " + json.dumps(dict(device=torch.cuda.get_device_name(device), records=records)))
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
