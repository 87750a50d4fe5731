"""Step 3 of gpu_check (and `benchmarks/moe_layer.py --device cuda`): one MoE layer's speed at 16,384 tokens in bf16.

Contestants, interleaved within each repeat so that a busy device slows each alike, at a Mixtral-like layer
(H 4096, I 14336, E 8, k 2) and a Qwen3-30B-A3B-like one (H 2048, I 768, E 128, k 8):
  * hf_moe triton        `SparseMoeBlock` on the Triton backend, Triton's GEMM kernels included
  * hf_moe triton, torch GEMMs   the same with torch's grouped_mm for its GEMMs, where that is the fast path (bf16
                         on sm90: what the Triton backend runs there, the CUDA default for bf16 on sm90)
  * hf_moe torch         the same block on the pure-torch ops (the default elsewhere on CUDA)
  * hf grouped_mm        transformers' `Qwen3MoeSparseMoeBlock`, experts_implementation="grouped_mm"
  * dense                a dense SwiGLU MLP of intermediate size k*I: the same active FLOPs, no routing
All MoE blocks hold the same router and expert weights, so they route alike. Printed: the median and the 20th-80th
percentile of the repeats in ms, forward and forward+backward, and dense's time / each one's ("vs dense").
With --smoke, the same code at tiny shapes on CPU tensors under Triton's interpreter: its times mean nothing.

A row is labelled Triton only where Triton ran: a Triton contestant that launched no Triton kernel, or any of whose
ops fell back to torch (hf_moe/ops/triton/ops.py), is labelled "NOT ..." with the ops named, and the step fails.
The record is flushed after each shape.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..configuration import MoEConfig
from ..layers import SparseMoeBlock
from ..ops import use_backend
from .correctness import SHAPES, TINY_SHAPES, own_gemms, variants  # the layers timed are those checked
from .record import FAILED, PASSED, table, triton_fallbacks

TOKENS = 16384
TINY_TOKENS = 8


class Backend(torch.nn.Module):
    """`module` run on one backend (with the Triton GEMM kernels when `own`)."""

    def __init__(self, module, backend, own=False):
        super().__init__()
        self.module, self.backend, self.own = module, backend, own

    def forward(self, x):
        with use_backend(self.backend), own_gemms(self.own):
            return self.module(x)


def build(hidden, num_experts, top_k, inter, dtype, device) -> dict[str, torch.nn.Module]:
    """{contestant: module} (see the module docstring), with shared weights."""
    from transformers import LlamaConfig, Qwen3MoeConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    base = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=8)
    config = MoEConfig.from_base(base, num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=inter)
    ours = SparseMoeBlock(config).to(device=device, dtype=dtype)
    qc = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts,
                        num_experts_per_tok=top_k, norm_topk_prob=True, num_hidden_layers=1)
    qc._experts_implementation = "grouped_mm"
    theirs = Qwen3MoeSparseMoeBlock(qc).to(device=device, dtype=dtype)
    with torch.no_grad():  # identical weights, so identical routing and identical work
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
        theirs.experts.down_proj.copy_(ours.experts.down_proj)
    dense = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=top_k * inter, mlp_bias=False))
    modules = {f"hf_moe {label}": Backend(ours, backend, own) for label, backend, own in variants(torch.device(device))}
    modules.update({"hf_moe torch": Backend(ours, "torch"), "hf grouped_mm": theirs,
                    "dense": dense.to(device=device, dtype=dtype)})
    return modules


def sync(device):
    """Wait for `device`'s queued kernels (a timer reads the clock after them)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_output(out):
    """A layer's output: the hidden states of a (hidden states, router logits) pair, else the output itself."""
    return out[0] if isinstance(out, tuple) else out


def triton_launches() -> int:
    """Triton kernel launches so far in this process (all kernels)."""
    from ..ops.triton.runtime import launch_counts

    return sum(launch_counts.values())


def measure(modules, x, repeats) -> tuple[dict[str, tuple[list[float], list[float]]], dict[str, int]]:
    """({contestant: (forward ms per repeat, forward+backward ms per repeat)}, {contestant: Triton kernel launches}),
    interleaved, after one warm-up each (which also autotunes the Triton GEMMs)."""
    grad = torch.randn_like(x)
    launches = dict.fromkeys(modules, 0)

    def fwd(module):
        with torch.no_grad():
            first_output(module(x))

    def fwd_bwd(module):
        first_output(module(x.detach().requires_grad_(True))).backward(grad)
        module.zero_grad(set_to_none=True)

    def counted(name, fn, module):
        before = triton_launches()
        fn(module)
        launches[name] += triton_launches() - before

    times = {name: ([], []) for name in modules}
    for name, module in modules.items():
        counted(name, fwd, module)
        counted(name, fwd_bwd, module)
    for _ in range(repeats):
        for name, module in modules.items():
            for slot, fn in enumerate((fwd, fwd_bwd)):
                sync(x.device)
                start = time.perf_counter()
                fn(module)
                sync(x.device)
                times[name][slot].append((time.perf_counter() - start) * 1e3)
    return times, launches


def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, 20th percentile, 80th percentile)."""
    q = statistics.quantiles(values, n=5, method="inclusive") if len(values) > 1 else [values[0]] * 4
    return statistics.median(values), q[0], q[-1]


def run(device: torch.device, smoke: bool, repeats: int, dtype=torch.bfloat16, flush=None) -> list[dict]:
    """One row per (shape, contestant): medians and spreads in ms, the ratios to dense, and for the Triton contestants
    whether Triton ran (`triton_ran`; else `impl` says "NOT ..." and names the ops that fell back). `flush(rows)`
    after each shape."""
    shapes, tokens = (TINY_SHAPES, TINY_TOKENS) if smoke else (SHAPES, TOKENS)
    rows = []
    for label, hidden, num_experts, top_k, inter in shapes:
        torch.manual_seed(0)
        modules = build(hidden, num_experts, top_k, inter, dtype, device)
        x = torch.randn(1, tokens, hidden, dtype=dtype, device=device)
        times, launches = measure(modules, x, repeats)
        fell = sorted(triton_fallbacks())  # sticky in the process: the Triton contestants ran torch for these ops
        dense_f, dense_fb = (statistics.median(t) for t in times["dense"])
        for name, (f, fb) in times.items():
            (fm, f20, f80), (bm, b20, b80) = median_spread(f), median_spread(fb)
            triton = isinstance(modules[name], Backend) and modules[name].backend == "triton"
            ran = not triton or (launches[name] > 0 and not fell)
            impl = name if ran else f"NOT {name}: " + (f"{', '.join(fell)} fell back to torch" if fell else
                                                        "no Triton kernel launched")
            rows.append(dict(shape=label, tokens=tokens, impl=impl, fwd_ms=fm, fwd_p20=f20, fwd_p80=f80,
                             fwd_vs_dense=dense_f / fm, fwd_bwd_ms=bm, fwd_bwd_p20=b20, fwd_bwd_p80=b80,
                             fwd_bwd_vs_dense=dense_fb / bm, triton_launches=launches[name] if triton else None,
                             triton_ran=ran if triton else None, fell_back=fell if triton else []))
        del modules
        if flush is not None:
            flush(rows)
    return rows


def format_rows(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    return table(["shape", "tokens", "impl", "fwd ms [p20-p80]", "vs dense", "fwd+bwd ms [p20-p80]", "vs dense"], [
        [r["shape"], r["tokens"], r["impl"], f"{r['fwd_ms']:.3f} [{r['fwd_p20']:.3f}-{r['fwd_p80']:.3f}]",
         f"{r['fwd_vs_dense']:.2f}", f"{r['fwd_bwd_ms']:.3f} [{r['fwd_bwd_p20']:.3f}-{r['fwd_bwd_p80']:.3f}]",
         f"{r['fwd_bwd_vs_dense']:.2f}"] for r in rows])


def step_speed(step, smoke: bool, limit: float) -> None:
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    repeats = 1 if smoke else 7
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter"

    def flush(rows):
        step.data = dict(device=name, repeats=repeats, rows=rows)
        step.detail = (f"{name}, torch {torch.__version__}, bf16, median of {repeats} repeats [20th-80th percentile]"
                       f"{'; --smoke: tiny shapes, the times mean nothing' if smoke else ''}.\n\n{format_rows(rows)}")
        step.flush()

    rows = run(device, smoke, repeats, flush=flush)
    not_triton = sorted({r["impl"] for r in rows if r["triton_ran"] is False})
    step.status = FAILED if not_triton else PASSED
    step.summary = (f"{len(rows)} rows measured" + (" (tiny: times mean nothing)" if smoke else "")
                    + (f"; Triton did not run in: {'; '.join(not_triton)}" if not_triton else ""))
