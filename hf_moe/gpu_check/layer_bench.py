"""The layer step of `python -m hf_moe.gpu_check.bench`: one MoE layer's speed and activation memory, side by side
with the other MoE implementations, in bf16, at 16,384 and 32,768 tokens.

Shapes (H hidden, I expert intermediate, E experts, k per token, S shared experts of intermediate I):
    Qwen3-30B-A3B-like   H 2048, I 768,   E 128, k 8
    OLMoE-like           H 2048, I 1024,  E 64,  k 8
    DeepSeek-V2-Lite-like H 2048, I 1408, E 64,  k 6, S 2
    Mixtral-like         H 4096, I 14336, E 8,   k 2
Contestants, each a whole layer (router, routed experts, shared experts), all holding the same weights, so they
route alike (their outputs are held against hf_moe's, `rel diff`):
    hf_moe triton[, torch GEMMs]  `SparseMoeBlock` on the Triton backend (own GEMMs; with torch's grouped_mm for the
                                  GEMMs where that is the default, bf16 on sm90)
    transformers grouped_mm       transformers' own block (Qwen3-MoE's, DeepSeek-V2's with shared experts) built by
                                  `from_config(..., experts_implementation="grouped_mm")`
    liger fused MoE               Liger-Kernel's `LigerFusedMoEFunction` (liger_kernel.ops.fused_moe; what its
                                  `LigerExperts` calls) after hf_moe's router, plus hf_moe's shared experts
    sonicmoe                      reported absent unless importable (its wheels do not fit the device's 64 MiB)
    dense                         a SwiGLU MLP of intermediate k*I + S*I: the same active FLOPs (and parameters), no
                                  routing
A contestant that is not installed or fails (to build, to run, out of memory) is a row that says so; the others go
on. TF/s counts a layer's active FLOPs: forward T x (6 H I k + 6 H I S + 2 H E), the router's 2 H E included;
backward twice the forward. The dense MLP is credited with its own FLOPs (the same, less the router's).
Memory (at the first token count): what each keeps for its backward, as the saved tensors' distinct storages
(parameters excluded; `hf_moe.profiling.saved_activation_bytes`) and, on CUDA, as the memory still allocated after
the forward less its output.

With --smoke the same code runs at tiny shapes on CPU tensors under Triton's interpreter: its times mean nothing.
"""

from __future__ import annotations

import importlib.util
import os
import time

import torch
from torch import nn

from ..configuration import MoEConfig
from ..layers import SparseMoeBlock
from ..profiling import saved_activation_bytes
from .correctness import rel_error, variants
from .record import FAILED, PASSED, table, triton_fallbacks
from .speed import Backend, first_output, median_spread, sync, triton_launches

# (label, H, I, E, k, shared experts)
SHAPES = [("Qwen3-30B-A3B-like", 2048, 768, 128, 8, 0), ("OLMoE-like", 2048, 1024, 64, 8, 0),
          ("DeepSeek-V2-Lite-like", 2048, 1408, 64, 6, 2), ("Mixtral-like", 4096, 14336, 8, 2, 0)]
TOKENS = (16384, 32768)
# --smoke: one shape without and one with shared experts, few experts (the interpreter runs every program of a grid
# sized for the worst case), one token count, fp32 (the interpreter has no bf16 for Liger's kernels).
TINY_SHAPES = [("Qwen3-30B-A3B-like tiny", 32, 8, 8, 4, 0), ("DeepSeek-V2-Lite-like tiny", 32, 16, 4, 2, 2)]
TINY_TOKENS = (8,)
REPEATS, SMOKE_REPEATS = 5, 1
# SonicMoE is not carried to the device: its wheels are larger than a device call may carry (their sizes, and how
# they were read, are in docs/backends.md, "Second light"); the report's rows say so.
SONIC_ABSENT = ("absent: not carried: sonic-moe 0.1.2.post1 needs nvidia-cutlass-dsl 4.4.2, whose libs-base wheel "
                "(74.4 MB) and libs-cu13 wheel (78.4 MB) each exceed the 64 MiB a device call carries, and pins "
                "torch<=2.9.1")
LIGER_AUTOTUNE = "LIGER_FUSED_MOE_AUTOTUNE"


def layer_flops(hidden: int, inter: int, num_experts: int, top_k: int, shared: int, tokens: int,
                router: bool = True) -> float:
    """Forward FLOPs of one layer's active work: the k routed experts' and the shared experts' SwiGLU GEMMs (3 of
    them, 2 FLOPs a multiply-add), and the router's [H, E] product when `router`."""
    per_token = 6 * hidden * inter * (top_k + shared) + (2 * hidden * num_experts if router else 0)
    return float(tokens) * per_token


class LigerLayer(nn.Module):
    """hf_moe's router and shared experts around Liger-Kernel's fused routed experts (`LigerFusedMoEFunction`, the
    op its `LigerExperts` runs), on `block`'s own weights: x [..., H] -> [..., H]."""

    def __init__(self, block: SparseMoeBlock, function):
        super().__init__()
        self.block, self.function = block, function

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.block.gate(flat)
        experts = self.block.experts
        out = self.function.apply(flat, experts.gate_up_proj, experts.down_proj,
                                  routing.top_k_index.to(torch.int32), routing.top_k_weights.to(flat.dtype))
        if self.block.shared_experts is not None:
            out = out + self.block.shared_experts(flat)
        return out.view(shape)


def liger_function():
    """(Liger's fused MoE autograd function, "") or (None, why not)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None, ("absent: liger-kernel is not installed (scripts/gpu_bench.sh installs the wheel it finds in "
                      ".whl-bench/)")
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except Exception as err:  # an installed but broken package is a result to report, not a crash
        return None, f"failed: import liger_kernel.ops.fused_moe: {type(err).__name__}: {err}"
    return LigerFusedMoEFunction, ""


def sonic_status() -> str:
    if importlib.util.find_spec("sonicmoe") is None:
        return SONIC_ABSENT
    return "absent: sonicmoe is installed, but this harness has no adapter for it (not measured)"


def _hf_block(hidden, inter, num_experts, top_k, shared, dtype, device):
    """transformers' own MoE block with grouped_mm experts, from a 1-layer model built by the public
    `from_config(..., experts_implementation="grouped_mm")` (its tiny vocabulary is never used)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(hidden_size=hidden, moe_intermediate_size=inter, num_experts_per_tok=top_k, num_hidden_layers=1,
                  vocab_size=64, num_attention_heads=16, num_key_value_heads=4, intermediate_size=4 * hidden)
    if shared:
        config = AutoConfig.for_model("deepseek_v2", **common, n_routed_experts=num_experts, n_shared_experts=shared,
                                      first_k_dense_replace=0, topk_method="greedy", n_group=1, topk_group=1,
                                      routed_scaling_factor=1.0, norm_topk_prob=False, q_lora_rank=None,
                                      kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
    else:
        config = AutoConfig.for_model("qwen3_moe", **common, num_experts=num_experts, norm_topk_prob=True,
                                      head_dim=hidden // 16)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, experts_implementation="grouped_mm", dtype=dtype)
    return model.model.layers[0].mlp


def _copy_weights(theirs, ours: SparseMoeBlock) -> None:
    with torch.no_grad():  # identical weights, so identical routing and identical work
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
        theirs.experts.down_proj.copy_(ours.experts.down_proj)
        if ours.shared_experts is not None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(theirs.shared_experts, name).weight.copy_(getattr(ours.shared_experts, name).weight)


def build(hidden, inter, num_experts, top_k, shared, dtype, device) -> tuple[dict, dict, SparseMoeBlock]:
    """({contestant: module}, {contestant: why it is absent or failed}, hf_moe's block), all on shared weights."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    base = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=8)
    config = MoEConfig.from_base(base, num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                                 num_shared_experts=shared, norm_topk_prob=not shared)
    with torch.device(device):  # initialised where it runs: a Mixtral-like layer is 1.4B parameters
        ours = SparseMoeBlock(config).to(dtype=dtype)
    modules = {f"hf_moe {label}": Backend(ours, backend, own) for label, backend, own in variants(device)}
    missing = {}
    try:
        theirs = _hf_block(hidden, inter, num_experts, top_k, shared, dtype, device)
        _copy_weights(theirs, ours)
        modules["transformers grouped_mm"] = theirs
    except Exception as err:  # a contestant that cannot be built is a row that says so
        missing["transformers grouped_mm"] = f"failed: {type(err).__name__}: {err}"
    function, why = liger_function()
    if function is not None:
        modules["liger fused MoE"] = LigerLayer(ours, function)
    else:
        missing["liger fused MoE"] = why
    missing["sonicmoe"] = sonic_status()
    with torch.device(device):
        dense = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=(top_k + shared) * inter, mlp_bias=False,
                                     num_attention_heads=8))
    modules["dense"] = dense.to(dtype=dtype)
    return modules, missing, ours


def _failure(err: BaseException) -> str:
    if isinstance(err, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
        return "failed: out of GPU memory"
    return f"failed: {type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"


def measure(modules: dict, x: torch.Tensor, repeats: int, failed: dict) -> tuple[dict, dict, dict]:
    """({contestant: (forward ms, forward+backward ms) per repeat}, {contestant: Triton launches}, {contestant:
    output [T, H] of its warm-up forward}), interleaved within each repeat after one warm-up each (which also
    autotunes). A contestant that raises is moved to `failed` with its error; the others go on."""
    grad = torch.randn_like(x)
    launches, outputs = dict.fromkeys(modules, 0), {}

    def fwd(module):
        with torch.no_grad():
            return first_output(module(x))

    def fwd_bwd(module):
        first_output(module(x.detach().requires_grad_(True))).backward(grad)
        module.zero_grad(set_to_none=True)

    live = dict(modules)
    for name, module in modules.items():
        try:
            before = triton_launches()
            outputs[name] = fwd(module).detach().reshape(-1, x.shape[-1])
            fwd_bwd(module)
            sync(x.device)
            launches[name] = triton_launches() - before
        except Exception as err:  # recorded; the other contestants still run
            failed[name] = _failure(err)
            live.pop(name)
    times = {name: ([], []) for name in live}
    for _ in range(repeats):
        for name, module in list(live.items()):
            for slot, fn in enumerate((fwd, fwd_bwd)):
                try:
                    sync(x.device)
                    start = time.perf_counter()
                    fn(module)
                    sync(x.device)
                except Exception as err:
                    failed[name] = _failure(err)
                    live.pop(name)
                    times.pop(name)
                    break
                times[name][slot].append((time.perf_counter() - start) * 1e3)
    return times, launches, outputs


def kept_for_backward(module, x: torch.Tensor) -> dict:
    """{saved: bytes of the tensors autograd saves (distinct storages, parameters excluded), allocated: bytes still
    allocated after the forward less its output (CUDA only, else None)}."""
    kept = dict(saved=saved_activation_bytes(module, x.detach().requires_grad_(True)), allocated=None)
    module.zero_grad(set_to_none=True)
    if x.device.type == "cuda":
        inp = x.detach().requires_grad_(True)
        torch.cuda.synchronize(x.device)
        before = torch.cuda.memory_allocated(x.device)
        out = first_output(module(inp))
        torch.cuda.synchronize(x.device)
        kept["allocated"] = torch.cuda.memory_allocated(x.device) - before - out.numel() * out.element_size()
        out.sum().backward()
        del out
        module.zero_grad(set_to_none=True)
    return kept


def measure_shape(spec, tokens: int, device, dtype, repeats: int, memory: bool) -> list[dict]:
    """The rows of one (shape, token count): one per contestant, measured or saying why not."""
    label, hidden, inter, num_experts, top_k, shared = spec
    torch.manual_seed(0)
    modules, failed, ours = build(hidden, inter, num_experts, top_k, shared, dtype, device)
    x = torch.randn(1, tokens, hidden, dtype=dtype, device=device)
    times, launches, outputs = measure(modules, x, repeats, failed)
    fell = sorted(triton_fallbacks())  # sticky in the process: the Triton contestants ran torch for these ops
    moe_flops = layer_flops(hidden, inter, num_experts, top_k, shared, tokens)
    dense_flops = layer_flops(hidden, inter, num_experts, top_k, shared, tokens, router=False)
    reference = next((outputs[n] for n in outputs if n.startswith("hf_moe")), None)
    rows = []
    base = dict(shape=label, tokens=tokens)
    for name in list(modules) + [n for n in failed if n not in modules]:
        if name not in times:
            rows.append(dict(base, impl=name, status=failed.get(name, "failed")))
            continue
        (fm, f20, f80), (bm, b20, b80) = median_spread(times[name][0]), median_spread(times[name][1])
        flops = dense_flops if name == "dense" else moe_flops
        row = dict(base, impl=name, status="measured", fwd_ms=fm, fwd_p20=f20, fwd_p80=f80, fwd_bwd_ms=bm,
                   fwd_bwd_p20=b20, fwd_bwd_p80=b80, fwd_tflops=flops / fm / 1e9, fwd_bwd_tflops=3 * flops / bm / 1e9)
        if name.startswith("hf_moe"):
            ran = launches[name] > 0 and not fell
            row.update(triton_launches=launches[name], triton_ran=ran, fell_back=fell)
            if not ran:
                row["impl"] = f"NOT {name}: " + (f"{', '.join(fell)} fell back to torch" if fell else
                                                  "no Triton kernel launched")
        if name != "dense" and reference is not None:
            row["rel_diff"] = rel_error(outputs[name].float(), reference.float())
        if memory:
            try:
                row.update(kept_for_backward(modules[name], x))
            except Exception as err:  # the speed stands; the memory says why it is missing
                row["memory_error"] = _failure(err)
        rows.append(row)
    dense = next((r for r in rows if r["impl"] == "dense" and r["status"] == "measured"), None)
    for row in rows:
        if dense is not None and row["status"] == "measured":
            row["fwd_vs_dense"] = row["fwd_tflops"] / dense["fwd_tflops"]
            row["fwd_bwd_vs_dense"] = row["fwd_bwd_tflops"] / dense["fwd_bwd_tflops"]
            if row.get("saved") is not None and dense.get("saved"):
                row["saved_vs_dense"] = row["saved"] / dense["saved"]
            if row.get("allocated") is not None and dense.get("allocated"):
                row["allocated_vs_dense"] = row["allocated"] / dense["allocated"]
    del modules, ours, x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _cell(row, key, fmt="{:.0f}"):
    value = row.get(key)
    return fmt.format(value) if value is not None else ""


def speed_table(rows: list[dict]) -> str:
    """The speed rows as a markdown table (docs/backends.md's form)."""
    out = []
    for r in rows:
        if r["status"] != "measured":
            out.append([r["shape"], r["tokens"], r["impl"], r["status"], "", "", "", "", ""])
            continue
        out.append([r["shape"], r["tokens"], r["impl"],
                    f"{r['fwd_ms']:.3f} [{r['fwd_p20']:.3f}-{r['fwd_p80']:.3f}]", f"{r['fwd_tflops']:.0f}",
                    _cell(r, "fwd_vs_dense", "{:.2f}"),
                    f"{r['fwd_bwd_ms']:.3f} [{r['fwd_bwd_p20']:.3f}-{r['fwd_bwd_p80']:.3f}]",
                    f"{r['fwd_bwd_tflops']:.0f}", _cell(r, "fwd_bwd_vs_dense", "{:.2f}")])
    return table(["shape", "tokens", "impl", "fwd ms [p20-p80]", "fwd TF/s", "vs dense", "fwd+bwd ms [p20-p80]",
                  "fwd+bwd TF/s", "vs dense"], out)


def memory_table(rows: list[dict]) -> str:
    """Activation memory kept for the backward, MB, and its ratio to the dense MLP's."""
    def mb(row, key):
        return f"{row[key] / 1e6:.1f}" if row.get(key) is not None else row.get("memory_error", "")

    out = [[r["shape"], r["tokens"], r["impl"], mb(r, "saved"), _cell(r, "saved_vs_dense", "{:.2f}"),
            mb(r, "allocated"), _cell(r, "allocated_vs_dense", "{:.2f}"), _cell(r, "rel_diff", "{:.1e}")]
           for r in rows if r["status"] == "measured" and ("saved" in r or "memory_error" in r)]
    return table(["shape", "tokens", "impl", "saved MB", "vs dense", "allocated MB", "vs dense",
                  "rel diff vs hf_moe"], out)


def step_layers(step, smoke: bool, limit: float) -> None:
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    shapes, counts = (TINY_SHAPES, TINY_TOKENS) if smoke else (SHAPES, TOKENS)
    repeats = SMOKE_REPEATS if smoke else REPEATS
    dtype = torch.float32 if smoke else torch.bfloat16
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter"
    start, rows, skipped = time.monotonic(), [], []
    liger = "autotuned" if os.environ.get(LIGER_AUTOTUNE, "1").lower() not in ("0", "false", "no") else \
        "one pinned config each (LIGER_FUSED_MOE_AUTOTUNE=0: its autotuner would time about 240 configurations per " \
        "layer shape, compiling each, more than one device call holds)"
    for tokens in counts:  # every shape at the first token count (the goals' count) before any at the second
        for spec in shapes:
            spent = time.monotonic() - start
            if rows and spent > 0.75 * limit:  # a quarter of the step's time is kept for the shape started last
                skipped.append(f"{spec[0]} at {tokens} tokens")
                continue
            rows += measure_shape(spec, tokens, device, dtype, repeats, memory=tokens == counts[0])
            step.data = dict(device=name, repeats=repeats, liger=liger, rows=rows, skipped=skipped)
            step.detail = _detail(name, dtype, repeats, liger, rows, skipped, smoke)
            step.flush()
    step.data = dict(device=name, repeats=repeats, liger=liger, rows=rows, skipped=skipped)
    step.detail = _detail(name, dtype, repeats, liger, rows, skipped, smoke)
    not_triton = sorted({r["impl"] for r in rows if r.get("triton_ran") is False})
    failed = sorted({f"{r['impl']} ({r['shape']}, {r['tokens']})" for r in rows
                     if r["status"].startswith("failed") and r["impl"].startswith("hf_moe")})
    step.status = FAILED if not_triton or failed else PASSED
    measured = sum(r["status"] == "measured" for r in rows)
    step.summary = (f"{measured} rows measured, {len(rows) - measured} absent or failed"
                    + (" (tiny: times mean nothing)" if smoke else "")
                    + (f"; not measured for want of time: {', '.join(skipped)}" if skipped else "")
                    + (f"; Triton did not run in: {'; '.join(not_triton)}" if not_triton else "")
                    + (f"; hf_moe failed: {'; '.join(failed)}" if failed else ""))


def _detail(name, dtype, repeats, liger, rows, skipped, smoke) -> str:
    goals = _goals(rows)
    return (f"{name}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, median of {repeats} repeats "
            f"[20th-80th percentile]; TF/s on "
            f"active FLOPs, the router's included (forward T x (6 H I (k + S) + 2 H E), backward 2x); the dense MLP "
            f"of intermediate (k + S) I on its own FLOPs; Liger: {liger}"
            + ("; --smoke: tiny shapes, the times mean nothing" if smoke else "") + ".\n\n" + speed_table(rows)
            + "\n\nKept for the backward, against the dense MLP of equal active parameters (saved: distinct saved "
              "storages, parameters excluded; allocated: memory held after the forward less its output, CUDA only); "
              "rel diff: the output against hf_moe's first row (same weights, same routing):\n\n" + memory_table(rows)
            + (f"\n\nGoals at the first token count:\n\n{goals}" if goals else "")
            + (f"\n\nNot measured for want of time: {', '.join(skipped)}" if skipped else ""))


def _goals(rows: list[dict]) -> str:
    """The issue's goals per shape at the first token count: hf_moe's best row against 475/450 TF/s (fine-grained)
    or the dense MLP (Mixtral-like), and against each competitor that ran."""
    lines = []
    first = min((r["tokens"] for r in rows), default=None)
    for shape in dict.fromkeys(r["shape"] for r in rows):
        here = [r for r in rows if r["shape"] == shape and r["tokens"] == first and r["status"] == "measured"]
        ours = [r for r in here if r["impl"].startswith("hf_moe")]
        if not ours:
            continue
        best = max(ours, key=lambda r: r["fwd_bwd_tflops"])
        parts = [f"{shape}: hf_moe best ({best['impl']}) {best['fwd_tflops']:.0f} / {best['fwd_bwd_tflops']:.0f} TF/s"]
        if "Mixtral" in shape:
            parts.append(f"vs dense {best.get('fwd_vs_dense', float('nan')):.2f} / "
                         f"{best.get('fwd_bwd_vs_dense', float('nan')):.2f} (goal >= 1.0)")
        else:
            parts.append(f"goal 475 / 450: {'met' if best['fwd_tflops'] >= 475 else 'missed'} / "
                         f"{'met' if best['fwd_bwd_tflops'] >= 450 else 'missed'}")
        for other in here:
            if other["impl"] in ("transformers grouped_mm", "liger fused MoE"):
                parts.append(f"vs {other['impl']} {best['fwd_tflops'] / other['fwd_tflops']:.2f}x / "
                             f"{best['fwd_bwd_tflops'] / other['fwd_bwd_tflops']:.2f}x")
        if best.get("saved_vs_dense") is not None:
            parts.append(f"saved {best['saved_vs_dense']:.2f}x dense (goal <= 1.1)")
        lines.append("- " + "; ".join(parts))
    return "\n".join(lines)

