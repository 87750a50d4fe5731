"""Speed of one MoE layer, against transformers' own MoE block and a dense MLP with the same active FLOPs.

    python benchmarks/moe_layer.py [--repeats 7] [--dtype float32] [--shapes all]

For each shape, in one run and interleaved (so load on a shared machine hits every contestant alike):
  * hf_moe       our `SparseMoeBlock` (router + fused experts + sort/grouped-GEMM dispatch), compiled ops
  * hf_moe torch the same block on the pure-torch ops
  * hf eager     transformers' `Qwen3MoeSparseMoeBlock`, experts_implementation="eager" (loop over hit experts)
  * hf grouped   the same block with experts_implementation="grouped_mm"
  * dense        a dense SwiGLU MLP of intermediate size k*I over the same tokens: the FLOPs one MoE layer
                 spends per token, with no routing at all, i.e. the speed limit.
All MoE blocks get the same router and expert weights, so they route identically (checked: max |diff|).

Printed: median milliseconds for forward and forward+backward, and dense_time / time ("vs dense", higher is
better, 1.0 = as fast as the dense MLP). Ratios are what to read; absolute times on a shared machine are noise.
"saved MB" is what each keeps for backward (activations, not parameters), and its ratio to the dense MLP's.
A second table times inference only (torch.inference_mode) on decode-like batches of 1 to 16 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, Qwen3MoeConfig
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from hf_moe import MoEConfig, SparseMoeBlock
from hf_moe.ops import use_backend
from hf_moe.profiling import saved_activation_bytes

HIDDEN = 512
# (name, experts E, top-k, expert intermediate I, tokens)
SHAPES = [
    ("E8 k2 I1024 T4096", 8, 2, 1024, 4096),
    ("E64 k8 I256 T4096", 64, 8, 256, 4096),
    ("E8 k2 I1024 T256", 8, 2, 1024, 256),
]


def build(num_experts, top_k, inter, dtype):
    base = LlamaConfig(hidden_size=HIDDEN, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=8)
    config = MoEConfig.from_base(base, num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=inter)
    ours = SparseMoeBlock(config).to(dtype)

    theirs = {}
    for impl in ("eager", "grouped_mm"):
        qc = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=inter, num_experts=num_experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True, num_hidden_layers=1)
        qc._experts_implementation = impl
        block = Qwen3MoeSparseMoeBlock(qc).to(dtype)
        with torch.no_grad():  # identical weights, so identical routing and identical work
            block.gate.weight.copy_(ours.gate.weight)
            block.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
            block.experts.down_proj.copy_(ours.experts.down_proj)
        theirs[impl] = block

    dense = LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=top_k * inter, mlp_bias=False)).to(dtype)
    return {
        "hf_moe": ours, "hf_moe torch": _Backend(ours, "torch"), "hf eager": theirs["eager"],
        "hf grouped": theirs["grouped_mm"], "dense": dense,
    }


class _Backend(torch.nn.Module):
    """`module` run with the ops of one backend."""

    def __init__(self, module, backend):
        super().__init__()
        self.module, self.backend = module, backend

    def forward(self, x):
        with use_backend(self.backend):
            return self.module(x)


def _forward(module, x):
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def measure(modules, x, repeats):
    """{name: (fwd_ms, fwd_bwd_ms)} medians, contestants interleaved within each repeat."""
    grad = torch.randn_like(x)
    times = {name: ([], []) for name in modules}

    def fwd(module):
        with torch.no_grad():
            _forward(module, x)

    def fwd_bwd(module):
        xr = x.detach().requires_grad_(True)
        _forward(module, xr).backward(grad)
        module.zero_grad(set_to_none=True)

    for name, module in modules.items():  # warm up
        fwd(module)
        fwd_bwd(module)
    for _ in range(repeats):
        for name, module in modules.items():
            for slot, fn in enumerate((fwd, fwd_bwd)):
                start = time.perf_counter()
                fn(module)
                times[name][slot].append((time.perf_counter() - start) * 1e3)
    return {name: (statistics.median(f), statistics.median(fb)) for name, (f, fb) in times.items()}


DECODE_SHAPES = [("E8 k2 I1024", 8, 2, 1024), ("E64 k8 I256", 64, 8, 256)]
DECODE_TOKENS = [1, 2, 4, 8, 16]


def measure_inference(modules, x, repeats):
    """{name: fwd_ms} medians under torch.inference_mode, interleaved."""
    times = {name: [] for name in modules}
    with torch.inference_mode():
        for module in modules.values():
            for _ in range(3):
                _forward(module, x)
        for _ in range(repeats):
            for name, module in modules.items():
                start = time.perf_counter()
                for _ in range(10):
                    _forward(module, x)
                times[name].append((time.perf_counter() - start) * 1e2)  # ms per call
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shapes", default="all", help="comma-separated indices into SHAPES, or 'all', or 'none'")
    parser.add_argument("--no-decode", dest="decode", action="store_false", help="skip the inference table")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    named = {"all": SHAPES, "none": []}
    shapes = named[args.shapes] if args.shapes in named else [SHAPES[int(i)] for i in args.shapes.split(",")]
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, H={HIDDEN}, "
          f"median of {args.repeats}")
    header = (f"{'shape':<20} {'impl':<13} {'fwd ms':>9} {'vs dense':>9} {'fwd+bwd ms':>11} {'vs dense':>9} "
              f"{'saved MB':>8} {'vs dense':>8}")
    for name, num_experts, top_k, inter, tokens in shapes:
        modules = build(num_experts, top_k, inter, dtype)
        x = torch.randn(1, tokens, HIDDEN, dtype=dtype)  # [batch, seq, hidden], as in a decoder layer
        with torch.no_grad():
            ref = _forward(modules["hf_moe"], x)
            diff = max((_forward(modules[k], x) - ref).abs().max().item() for k in ("hf eager", "hf grouped"))
        results = measure(modules, x, args.repeats)
        saved = {impl: saved_activation_bytes(m, x.detach().requires_grad_(True)) for impl, m in modules.items()}
        dense_f, dense_fb = results["dense"]
        print(f"\n{header}\n{'-' * len(header)}")
        for impl, (f, fb) in results.items():
            print(f"{name:<20} {impl:<13} {f:>9.2f} {dense_f / f:>9.2f} {fb:>11.2f} {dense_fb / fb:>9.2f} "
                  f"{saved[impl] / 1e6:>8.1f} {saved[impl] / saved['dense']:>8.2f}")
        print(f"(max |output difference| hf_moe vs transformers: {diff:.1e})")

    if args.decode:
        print("\nInference only (torch.inference_mode), decode-like batches: ms per forward, and dense / time")
        names = ["hf_moe", "hf_moe torch", "hf eager", "hf grouped", "dense"]
        header = f"{'shape':<14} {'tokens':>6} " + " ".join(f"{n:>13}" for n in names)
        print(f"{header}\n{'-' * len(header)}")
        for name, num_experts, top_k, inter in DECODE_SHAPES:
            modules = build(num_experts, top_k, inter, dtype)
            for tokens in DECODE_TOKENS:
                x = torch.randn(1, tokens, HIDDEN, dtype=dtype)
                res = measure_inference(modules, x, args.repeats)
                cells = " ".join(f"{res[n]:>6.3f} ({res['dense'] / res[n]:.2f})" for n in names)
                print(f"{name:<14} {tokens:>6} {cells}")


if __name__ == "__main__":
    main()
