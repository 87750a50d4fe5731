"""Step 2 of gpu_check: hf_moe's Triton path against its torch path at the shapes of real MoE layers.

For each shape (Mixtral-like: H 4096, I 14336, E 8, k 2; Qwen3-30B-A3B-like: H 2048, I 768, E 128, k 8; shrunk with
--smoke) and routing (balanced, skewed: only k + 1 experts get rows, dropped: a sixth of the pairs dropped), one
expert layer in bf16, forward and backward:
  * the output, dX, the routing weights' gradient and dW of the Triton backend (and of the Triton backend with its
    own GEMM kernels where it would hand them to torch's grouped_mm) against the torch backend, as relative
    Frobenius errors;
  * experts without rows get exactly zero weight gradients, in every variant;
  * nothing is NaN or infinite, with the CUDA caching allocator first filled with NaN (poisoned), so a kernel that
    reads memory it never wrote shows up;
  * permute, the Triton GEMM and unpermute on a tensor past 2**31 elements (GPU only: ~15 GB);
  * each Triton run launched Triton kernels, and no op of it fell back to torch (a fallback would compare torch
    with torch): a row where one did says so, and the step fails.
The step's record is flushed after each case, so a run cut short keeps the cases it finished.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..ops import experts_forward, reference, use_backend
from .record import FAILED, PASSED, SKIPPED, table, triton_fallbacks

RTOL = 2e-2  # bf16 on both sides, fp32 sums in other orders: ~4e-3 expected
SHAPES = [("Mixtral-like", 4096, 8, 2, 14336), ("Qwen3-30B-A3B-like", 2048, 128, 8, 768)]
TINY_SHAPES = [("Mixtral-like tiny", 32, 8, 2, 24), ("Qwen3-30B-A3B-like tiny", 32, 16, 8, 8)]
ROUTINGS = ("balanced", "skewed", "dropped")


class Experts(nn.Module):
    """A SwiGLU experts module in transformers' fused layout (what `experts_forward` takes)."""

    def __init__(self, num_experts, hidden, inter, device, dtype=torch.bfloat16, seed=0):
        super().__init__()
        self.num_experts, self.has_gate, self.activation = num_experts, True, "silu"
        self.act_fn = ACT2FN["silu"]
        g = torch.Generator(device=device).manual_seed(seed)
        opts = dict(device=device, dtype=dtype)
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden, generator=g, **opts) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, inter, generator=g, **opts) * 0.02)


def routing(tokens: int, top_k: int, num_experts: int, mode: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_index [N, k], top_k_weights [N, k]) for a routing mode."""
    g = torch.Generator(device="cpu").manual_seed(1)
    slots = torch.arange(tokens * top_k).view(tokens, top_k)
    if mode == "balanced":
        index = slots % num_experts
    elif mode == "skewed":  # k + 1 experts get every row; the others none (their gradients must be exactly zero)
        index = (slots + torch.arange(tokens).unsqueeze(1)) % (top_k + 1)
    else:  # dropped: a capacity limit drops about a sixth of the pairs (ids -1 and E)
        index = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
        index[::3, 0] = -1
        index[1::4, -1] = num_experts
    weights = torch.rand(tokens, top_k, generator=g)
    return index.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)


@contextlib.contextmanager
def own_gemms(enabled: bool):
    """The Triton backend with its own GEMM kernels (not torch's grouped_mm) inside the block, when `enabled`."""
    if not enabled:
        yield
        return
    from ..ops.triton import grouped_gemm

    grouped_gemm.TORCH_GEMM = False
    try:
        yield
    finally:
        grouped_gemm.TORCH_GEMM = True


def poison(device: torch.device) -> bool:
    """Fill the memory the CUDA caching allocator will hand out next with NaN. False on CPU (not possible)."""
    if device.type != "cuda":
        return False
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    blocks = [torch.empty(int(free * 0.6) // 2, dtype=torch.bfloat16, device=device)]
    blocks += [torch.empty(2**18, dtype=torch.bfloat16, device=device) for _ in range(64)]  # the small pool
    for block in blocks:
        block.fill_(float("nan"))
    torch.cuda.synchronize(device)
    del blocks  # cached, not returned: the next allocations reuse this memory as it is
    return True


def run_layer(experts, x, index, weights, grad, backend: str, own: bool = False):
    """{name: tensor}: the output and every gradient of one layer on `backend`."""
    experts.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    weights = weights.detach().requires_grad_(True)
    with use_backend(backend), own_gemms(own):
        out = experts_forward(experts, x, index, weights)
        out.backward(grad)
    return dict(out=out.detach(), dx=x.grad, dweights=weights.grad, dw1=experts.gate_up_proj.grad.clone(),
                dw2=experts.down_proj.grad.clone())


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def variants(device: torch.device) -> list[tuple[str, str, bool]]:
    """(label, backend, own GEMMs) of the runs compared with the torch backend: the Triton backend with its own GEMM
    kernels ("triton"), and where it hands its GEMMs to torch's grouped_mm by default (bf16 on sm90), that too
    ("triton, torch GEMMs")."""
    if device.type == "cuda" and reference.torch_grouped_mm_usable(device, (torch.bfloat16,), (8,)):
        return [("triton", "triton", True), ("triton, torch GEMMs", "triton", False)]
    return [("triton", "triton", False)]  # its own GEMMs: torch's grouped_mm is not used here


def check_shapes(step, device: torch.device, tokens: int, shapes) -> None:
    """Fill in `step` (see the module docstring)."""
    rows, problems, data = [], [], []
    poisoned = False
    for shape, hidden, num_experts, top_k, inter in shapes:
        experts = Experts(num_experts, hidden, inter, device)
        g = torch.Generator(device=device).manual_seed(2)
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g)
        grad = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g)
        for mode in ROUTINGS:
            index, weights = routing(tokens, top_k, num_experts, mode, device)
            empty = torch.bincount(index[(index >= 0) & (index < num_experts)].flatten(), minlength=num_experts) == 0
            poisoned |= poison(device)
            want = run_layer(experts, x, index, weights.bfloat16(), grad, "torch")
            runs = {"torch": want}
            for name, backend, own in variants(device):
                poisoned |= poison(device)
                start, launched = time.perf_counter(), _launches()
                runs[name] = run_layer(experts, x, index, weights.bfloat16(), grad, backend, own)
                errors = {k: rel_error(v, want[k]) for k, v in runs[name].items()}
                worst = max(errors, key=errors.get)
                fell = sorted(triton_fallbacks())  # sticky: an op that fell back before runs torch here too
                label = name if not fell else f"NOT {name}: {', '.join(fell)} fell back to torch"
                rows.append([shape, mode, label, *(f"{errors[k]:.1e}" for k in ("out", "dx", "dweights", "dw1", "dw2")),
                             f"{time.perf_counter() - start:.2f}"])
                data.append(dict(shape=shape, routing=mode, variant=name, errors=errors, fell_back=fell,
                                 launches=_launches() - launched))
                if errors[worst] > RTOL:
                    problems.append(f"{shape}, {mode}, {name}: {worst} off by {errors[worst]:.2e} (> {RTOL})")
                if fell or not data[-1]["launches"]:
                    problems.append(f"{shape}, {mode}, {name}: " + (
                        f"{', '.join(fell)} fell back to torch" if fell else "no Triton kernel launched"))
                step.data = dict(tokens=tokens, rtol=RTOL, poisoned_allocator=poisoned, cases=data)
                step.flush()
            for name, result in runs.items():
                if not all(t.isfinite().all() for t in result.values()):
                    problems.append(f"{shape}, {mode}, {name}: NaN or inf")
                if empty.any() and (result["dw1"][empty].any() or result["dw2"][empty].any()):
                    problems.append(f"{shape}, {mode}, {name}: non-zero weight gradient for an expert "
                                    "without rows")
    step.data = dict(tokens=tokens, rtol=RTOL, poisoned_allocator=poisoned, cases=data)
    step.detail = (f"{tokens} tokens, bf16; relative errors against the torch backend (tolerance {RTOL}); "
                   f"allocator {'poisoned with NaN before each run' if poisoned else 'not poisoned (CPU)'}.\n\n")
    step.detail += table(["shape", "routing", "variant", "out", "dX", "d weights", "dW1", "dW2", "s"], rows)
    if problems:
        step.detail += "\n\nProblems:\n" + "\n".join(f"- {p}" for p in problems)
    step.status = FAILED if problems else PASSED
    step.summary = (f"{len(problems)} problem(s): {problems[0]}" if problems else
                    f"{len(rows)} comparisons within {RTOL}; empty experts' gradients zero; no NaN"
                    + ("" if poisoned else " (CPU: allocator not poisoned)"))


def check_large_tensor(step, device: torch.device, smoke: bool) -> None:
    """permute, the Triton GEMM (reading its rows) and unpermute over a [M, H] tensor of more than 2**31 elements;
    with --smoke the same code at a tiny size, said so."""
    from ..ops.triton import grouped_gemm, permute

    hidden, num_experts, top_k = (32, 4, 2) if smoke else (2048, 16, 8)
    tokens = 64 if smoke else 2**31 // (top_k * hidden) + 64
    index = (torch.arange(tokens * top_k, device=device) % num_experts).view(tokens, top_k)
    sorted_slots, slot_to_row, counts = reference.sort_by_expert(index, num_experts)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    rows = permute.permute(x, sorted_slots, top_k)
    elements = rows.numel()
    problems = []
    if not torch.equal(rows, reference.permute(x, sorted_slots, top_k)):
        problems.append("permute differs from torch's index_select")
    w = torch.randn(num_experts, 64, hidden, device=device, dtype=torch.bfloat16) * 0.02
    got = grouped_gemm.grouped_mm(rows, w, counts, None, None, True, torch_gemm=False)
    m = rows.shape[0]
    tail = torch.arange(max(m - 256, 0), m, device=device)  # the last rows: past 2**31 elements on a GPU
    expert_of_tail = torch.searchsorted(torch.cumsum(counts, 0), tail, right=True)
    want_tail = torch.einsum("mh,moh->mo", rows[tail].float(), w[expert_of_tail].float())
    got = got[tail]
    if rel_error(got, want_tail) > RTOL:
        problems.append(f"grouped_mm's last rows off by {rel_error(got, want_tail):.2e}")
    del got
    combined = permute.unpermute(rows, slot_to_row, None, top_k)
    if rel_error(combined, x.float() * top_k) > 1e-2:
        problems.append("unpermute of the permuted rows is not k x the tokens")
    step.data = dict(elements=elements, past_2_31=elements > 2**31)
    scale = f"{elements:,} elements ({'past' if elements > 2**31 else 'not past'} 2**31)"
    step.detail = f"rows [{rows.shape[0]}, {hidden}] bf16: {scale}" + (
        "; --smoke: the same code at a tiny size (the 2**31 case needs ~15 GB of GPU memory)" if smoke else "")
    step.status = FAILED if problems else PASSED
    step.summary = "; ".join(problems) if problems else f"permute, GEMM, unpermute correct on {scale}"


def _launches() -> int:
    """Triton kernel launches so far in this process."""
    from ..ops.triton.runtime import launch_counts

    return sum(launch_counts.values())


def step_correctness(step, smoke: bool, limit: float) -> None:
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    tokens = 16 if smoke else 4096
    check_shapes(step, device, tokens, TINY_SHAPES if smoke else SHAPES)
    large = type(step)(0, "large")
    try:
        check_large_tensor(large, device, smoke)
    except torch.cuda.OutOfMemoryError as err:
        large.status, large.summary = SKIPPED, f"skipped: out of GPU memory ({err})"
    step.detail += f"\n\nTensor past 2**31 elements: {large.status}: {large.summary}\n{large.detail}"
    step.data["large_tensor"] = dict(status=large.status, summary=large.summary, **large.data)
    if large.status == FAILED:
        step.status = FAILED
        step.summary += f"; large tensor: {large.summary}"
