"""Speed of one MoE layer, against transformers' own MoE block and a dense MLP with the same active FLOPs.

    python benchmarks/moe_layer.py [--repeats 9] [--dtype float32] [--shapes all]             # CPU tables
    python benchmarks/moe_layer.py --device cuda --dtype bfloat16                             # GPU table
    python benchmarks/moe_layer.py --device cpu --interpret --tiny                            # GPU table's code,
                                                                                              # tiny, interpreted

CPU tables. For each shape, in one run and interleaved (so load on a shared machine hits every contestant alike):
  * hf_moe       our `SparseMoeBlock` (router + fused experts + sort/grouped-GEMM dispatch), compiled ops
  * hf_moe torch the same block on the pure-torch ops
  * hf eager     transformers' `Qwen3MoeSparseMoeBlock`, experts_implementation="eager" (loop over hit experts)
  * hf grouped   the same block with experts_implementation="grouped_mm"
  * dense        a dense SwiGLU MLP of intermediate size k*I over the same tokens: the FLOPs one MoE layer
                 spends per token, with no routing at all, i.e. the speed limit.
All MoE blocks get the same router and expert weights, so they route identically (checked: max |diff|).

Printed: milliseconds for forward and forward+backward (median and 20th-80th percentile of the repeats), and
dense_time / time per repeat ("vs dense", higher is better, 1.0 = as fast as the dense MLP). Ratios are what to
read; absolute times on a shared machine are noise. "of limit" is the layer's speed limit on this machine / its
time: the larger of the FLOP bound (active FLOPs at the GEMM rate of a 2048^3 matmul, measured in the same run)
and the byte bound (the weights of every expert the routing touches, twice with the backward for their gradients,
at the memory bandwidth measured in the same run: see MachineRates).
"saved MB" is what each keeps for backward (activations, not parameters), and its ratio to the dense MLP's.
A second table times inference only (torch.inference_mode) on decode-like batches of 1 to 16 tokens.

GPU table (`--device cuda`, or `--tiny`): 16,384 tokens through a Mixtral-like layer (H 4096, I 14336, E 8, k 2) and a
Qwen3-30B-A3B-like one (H 2048, I 768, E 128, k 8): hf_moe on its Triton backend (the default for bf16 on sm90;
torch's grouped_mm for the GEMMs where that is the fast path), hf_moe on the pure-torch ops (the default elsewhere on
CUDA), transformers' block with grouped_mm, and the dense chain. Median and spread (20th-80th percentile) of the
repeats, ratios against dense and against transformers' grouped_mm, and the share of hf_moe's time outside its expert
GEMMs (1 - time of the same GEMMs, replayed alone on the same routing, / time of the layer). `--tiny` shrinks the
shapes so that the same code runs end to end on CPU under Triton's interpreter (`--interpret` sets TRITON_INTERPRET=1
before triton is imported); its times mean nothing.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton: kernels are bound at definition

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
from spread import cell, median_spread  # benchmarks/spread.py

HIDDEN = 512
# (name, experts E, top-k, expert intermediate I, tokens)
SHAPES = [
    ("E8 k2 I1024 T4096", 8, 2, 1024, 4096),
    ("E64 k8 I256 T4096", 64, 8, 256, 4096),
    ("E8 k2 I1024 T256", 8, 2, 1024, 256),
]


def build(num_experts, top_k, inter, dtype, hidden=HIDDEN, device="cpu", eager=True, backend=None):
    """{name: module}: hf_moe (on `backend`), hf_moe torch, transformers' block (eager, grouped_mm), dense."""
    base = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=8)
    config = MoEConfig.from_base(base, num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=inter)
    ours = SparseMoeBlock(config).to(device=device, dtype=dtype)

    theirs = {}
    for impl in ("eager", "grouped_mm") if eager else ("grouped_mm",):
        qc = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True, num_hidden_layers=1)
        qc._experts_implementation = impl
        block = Qwen3MoeSparseMoeBlock(qc).to(device=device, dtype=dtype)
        with torch.no_grad():  # identical weights, so identical routing and identical work
            block.gate.weight.copy_(ours.gate.weight)
            block.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
            block.experts.down_proj.copy_(ours.experts.down_proj)
        theirs[impl] = block

    dense = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=top_k * inter, mlp_bias=False))
    dense = dense.to(device=device, dtype=dtype)
    modules = {"hf_moe": _Backend(ours, backend), "hf_moe torch": _Backend(ours, "torch")}
    if eager:
        modules["hf eager"] = theirs["eager"]
    return {**modules, "hf grouped": theirs["grouped_mm"], "dense": dense}


class _Backend(torch.nn.Module):
    """`module` run with the ops of one backend (None: whatever HF_MOE_BACKEND selects)."""

    def __init__(self, module, backend):
        super().__init__()
        self.module, self.backend = module, backend

    def forward(self, x):
        if self.backend is None:
            return self.module(x)
        with use_backend(self.backend):
            return self.module(x)


def _forward(module, x):
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def measure(modules, x, repeats):
    """{name: (fwd ms list, fwd+bwd ms list)}, contestants interleaved within each repeat."""
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
    return times


class MachineRates:
    """This machine's speeds, measured now (medians of `repeats`): the GEMM rate of a 2048^3 matmul, and the memory
    bandwidth, reading a 256 MB buffer (a sum). The limits divide by these. A working set that fits in the last-level
    cache (32 MB here; a decode layer's touched experts do, since the benchmark reuses one layer) is read faster than
    memory: `cache_bandwidth` (a 12 MB buffer) is printed beside it, and a decode ratio to the limit above 1 means
    the weights came from cache."""

    def __init__(self, dtype, repeats):
        a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        self.flop_rate = 2 * 2048**3 / (statistics.median(_timed(lambda: torch.mm(a, b), CPU, repeats)) / 1e3)
        self.memory_bandwidth = _read_rate(256 * 2**20, dtype, max(repeats, 9))
        self.cache_bandwidth = _read_rate(12 * 2**20, dtype, max(repeats, 9))

    def read_ms(self, nbytes: int) -> float:
        return nbytes / self.memory_bandwidth * 1e3


def _read_rate(nbytes, dtype, repeats) -> float:
    """bytes/s of summing a buffer of `nbytes` (read again and again)."""
    buffer = torch.empty(nbytes // dtype.itemsize, dtype=dtype).normal_()
    return nbytes / (statistics.median(_timed(buffer.sum, CPU, repeats)) / 1e3)


CPU = torch.device("cpu")


def layer_limit(block, x, rates, backward):
    """(limit ms, FLOP-bound ms, byte-bound ms) of one MoE layer on `x`: the active FLOPs (6 N k H I for a SwiGLU
    expert; x3 with the backward) at the measured GEMM rate, and the weights of every expert the routing touches
    (3 H I each) at the memory bandwidth, twice with the backward (their gradients are written, counted at the read
    rate). The limit is the larger."""
    flat = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        index = block.gate(flat).dispatch_index()
    experts = block.experts
    n, k = index.shape
    h, i = experts.hidden_dim, experts.intermediate_dim
    flops = 2 * n * k * 3 * h * i * (3 if backward else 1)
    touched = index[index >= 0].unique().numel()
    return _limit(flops, touched * 3 * h * i * x.element_size(), rates, backward)


def _limit(flops, weight_bytes, rates, backward):
    flop_ms = flops / rates.flop_rate * 1e3
    byte_ms = rates.read_ms(weight_bytes) * (2 if backward else 1)
    return max(flop_ms, byte_ms), flop_ms, byte_ms


DECODE_SHAPES = [("E8 k2 I1024", 8, 2, 1024), ("E64 k8 I256", 64, 8, 256)]
DECODE_TOKENS = [1, 2, 4, 8, 16]


def measure_inference(modules, x, repeats):
    """{name: [ms per forward, one per repeat (the mean of 10 calls)]} under torch.inference_mode, interleaved."""
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
    return times


# The GPU table: (name, hidden H, experts E, top-k, expert intermediate I), 16,384 tokens.
GPU_TOKENS = 16384
GPU_SHAPES = [("Mixtral-like", 4096, 8, 2, 14336), ("Qwen3-30B-A3B-like", 2048, 128, 8, 768)]
# --tiny: the same layers shrunk (k kept; E 16 instead of 128) so the code runs under Triton's interpreter in about
# a minute.
TINY_TOKENS = 8
TINY_SHAPES = [("Mixtral-like tiny", 32, 8, 2, 24), ("Qwen3-30B-A3B-like tiny", 32, 16, 8, 8)]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats):
    """Milliseconds of `fn()` per repeat (after one warm-up), synchronising the device around each."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _expert_gemms(block, x, backward):
    """A function replaying the expert GEMMs of `block`'s forward (and backward) on `x`'s routing, alone: the same
    calls, shapes, gathers and group sizes as the Triton backend's `WholeExperts`, and nothing else."""
    ops = torch.ops.hf_moe_triton
    experts = block.experts
    flat = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        routing = block.gate(flat)
        index, weights = routing.dispatch_index(), routing.top_k_weights.to(flat.dtype)
        top_k, w1, w2 = index.shape[-1], experts.gate_up_proj, experts.down_proj
        slots, _, counts = ops.sort_by_expert(index, w1.shape[0])
        row_weight = weights.reshape(-1).index_select(0, slots)
        h = ops.grouped_mm(flat, w1, counts, None, None, True, slots, top_k)
        a = ops.expert_act(h, row_weight, "silu", True)
        grad_out = torch.randn_like(flat)

    def run():
        with torch.no_grad():
            ops.grouped_mm(flat, w1, counts, None, None, True, slots, top_k)
            ops.grouped_mm(a, w2, counts, None, None, True)
            if backward:
                ops.grouped_mm(grad_out, w2, counts, None, None, False, slots, top_k)
                ops.grouped_mm_weight_grad(grad_out, a, counts, slots, top_k, "grad_out")
                ops.grouped_mm_weight_grad(h, flat, counts, slots, top_k, "x")  # h stands in for grad_h (same shape)
                ops.grouped_mm(h, w1, counts, None, None, False)

    return run


def gpu_table(args, device, dtype):
    tiny = args.tiny
    shapes, tokens = (TINY_SHAPES, TINY_TOKENS) if tiny else (GPU_SHAPES, GPU_TOKENS)
    backend = "triton"  # forced, on any GPU and dtype; the "hf_moe torch" row is the torch backend
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter"
    print(f"{name}, torch {torch.__version__}, {args.dtype}, {tokens} tokens, median of {args.repeats} "
          f"(20th-80th percentile){'; --tiny: times mean nothing' if tiny else ''}")
    header = (f"{'shape':<24} {'impl':<13} {'fwd ms':>8} {'spread':>13} {'vs dense':>8} {'vs hf gr':>8} "
              f"{'fwd+bwd ms':>10} {'spread':>13} {'vs dense':>8} {'vs hf gr':>8}")
    for label, hidden, num_experts, top_k, inter in shapes:
        torch.manual_seed(0)
        modules = build(num_experts, top_k, inter, dtype, hidden=hidden, device=device, eager=False, backend=backend)
        x = torch.randn(1, tokens, hidden, dtype=dtype, device=device)
        grad = torch.randn_like(x)
        with torch.no_grad():
            diff = (_forward(modules["hf_moe"], x) - _forward(modules["hf grouped"], x)).abs().max().item()

        def fwd(module):
            with torch.no_grad():
                _forward(module, x)

        def fwd_bwd(module):
            _forward(module, x.detach().requires_grad_(True)).backward(grad)
            module.zero_grad(set_to_none=True)

        results = {impl: (median_spread(_timed(lambda m=m: fwd(m), device, args.repeats)),
                          median_spread(_timed(lambda m=m: fwd_bwd(m), device, args.repeats)))
                   for impl, m in modules.items()}
        block = modules["hf_moe"].module
        with use_backend("triton"):
            gemm_f = statistics.median(_timed(_expert_gemms(block, x, False), device, args.repeats))
            gemm_fb = statistics.median(_timed(_expert_gemms(block, x, True), device, args.repeats))
        (dense_f, _, _), (dense_fb, _, _) = results["dense"]
        (hf_f, _, _), (hf_fb, _, _) = results["hf grouped"]
        print(f"\n{header}\n{'-' * len(header)}")
        for impl, ((f, f20, f80), (fb, fb20, fb80)) in results.items():
            print(f"{label:<24} {impl:<13} {f:>8.3f} {f20:>6.3f}-{f80:<6.3f} {dense_f / f:>8.2f} {hf_f / f:>8.2f} "
                  f"{fb:>10.3f} {fb20:>6.3f}-{fb80:<6.3f} {dense_fb / fb:>8.2f} {hf_fb / fb:>8.2f}")
        (ours_f, _, _), (ours_fb, _, _) = results["hf_moe"]
        print(f"hf_moe time outside its expert GEMMs: forward {max(0.0, 1 - gemm_f / ours_f):.0%}, "
              f"forward+backward {max(0.0, 1 - gemm_fb / ours_fb):.0%} (GEMMs alone: {gemm_f:.3f} / {gemm_fb:.3f} "
              f"ms); max |output difference| hf_moe vs transformers: {diff:.1e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", default="all", help="comma-separated indices into SHAPES, or 'all', or 'none'")
    parser.add_argument("--no-decode", dest="decode", action="store_false", help="skip the inference table")
    parser.add_argument("--tiny", action="store_true", help="the GPU table's shapes shrunk, to run it anywhere")
    parser.add_argument("--interpret", action="store_true", help="TRITON_INTERPRET=1: Triton kernels on CPU tensors")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    if device.type == "cuda" or args.tiny:
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--tiny on CPU runs the Triton kernels under their interpreter: add --interpret")
        gpu_table(args, device, dtype)
        return
    named = {"all": SHAPES, "none": []}
    shapes = named[args.shapes] if args.shapes in named else [SHAPES[int(i)] for i in args.shapes.split(",")]
    torch.manual_seed(0)
    rates = MachineRates(dtype, args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, H={HIDDEN}, "
          f"{args.repeats} repeats; this machine now: {rates.flop_rate / 1e9:.1f} GFLOP/s (2048^3 matmul), "
          f"reads {rates.memory_bandwidth / 1e9:.1f} GB/s from memory (256 MB; limits use this), "
          f"{rates.cache_bandwidth / 1e9:.1f} GB/s from cache (12 MB)")
    print("Times: median [20th-80th percentile] ms. vs dense: dense time / time, per repeat (contestants interleaved),"
          " median [20th-80th percentile]. of limit: the layer's limit / median time (see layer_limit).")
    header = (f"{'shape':<18} {'impl':<13} {'fwd ms':>21} {'vs dense':>17} {'fwd+bwd ms':>22} {'vs dense':>17} "
              f"{'of limit':>8} {'saved':>5}")
    for name, num_experts, top_k, inter, tokens in shapes:
        modules = build(num_experts, top_k, inter, dtype)
        x = torch.randn(1, tokens, HIDDEN, dtype=dtype)  # [batch, seq, hidden], as in a decoder layer
        with torch.no_grad():
            ref = _forward(modules["hf_moe"], x)
            diff = max((_forward(modules[k], x) - ref).abs().max().item() for k in ("hf eager", "hf grouped"))
        block = modules["hf_moe"].module
        limit, flop_ms, byte_ms = layer_limit(block, x, rates, backward=True)
        dense_flops = 2 * tokens * 3 * HIDDEN * top_k * inter * 3  # the same active FLOPs, fwd+bwd
        dense_limit = _limit(dense_flops, 3 * HIDDEN * top_k * inter * x.element_size(), rates, backward=True)[0]
        times = measure(modules, x, args.repeats)
        saved = {impl: saved_activation_bytes(m, x.detach().requires_grad_(True)) for impl, m in modules.items()}
        print(f"\n{name}: fwd+bwd limit {limit:.1f} ms (FLOP bound {flop_ms:.1f}, byte bound {byte_ms:.1f}); "
              f"dense's {dense_limit:.1f} ms")
        print(f"{header}\n{'-' * len(header)}")
        for impl, (f, fb) in times.items():
            cells = []
            for slot, series in enumerate((f, fb)):
                ratios = [d / t for d, t in zip(times["dense"][slot], series)]
                cells.append(f"{cell(series)} {cell(ratios, 2)}")
            own_limit = dense_limit if impl == "dense" else limit
            print(f"{name:<18} {impl:<13} {cells[0]} {cells[1]} {own_limit / statistics.median(fb):>8.2f} "
                  f"{saved[impl] / saved['dense']:>5.2f}")
        print(f"(max |output difference| hf_moe vs transformers: {diff:.1e}; saved: activations kept for backward "
              "/ dense's)")

    if args.decode:
        print("\nInference only (torch.inference_mode), decode-like batches: ms per forward, median "
              "[20th-80th percentile] and dense / time; limit: the touched experts' weight bytes at the measured "
              "read rate (or the FLOPs at the GEMM rate, if larger)")
        names = ["hf_moe", "hf_moe torch", "hf eager", "hf grouped", "dense"]
        header = f"{'shape':<12} {'tokens':>6} {'limit':>6} " + " ".join(f"{n:>26}" for n in names) + " of limit"
        print(f"{header}\n{'-' * len(header)}")
        for name, num_experts, top_k, inter in DECODE_SHAPES:
            modules = build(num_experts, top_k, inter, dtype)
            for tokens in DECODE_TOKENS:
                x = torch.randn(1, tokens, HIDDEN, dtype=dtype)
                limit = layer_limit(modules["hf_moe"].module, x, rates, backward=False)[0]
                res = measure_inference(modules, x, args.repeats)
                cells = " ".join(
                    f"{cell(res[n], 2)} ({statistics.median(d / t for d, t in zip(res['dense'], res[n])):.2f})"
                    for n in names
                )
                print(f"{name:<12} {tokens:>6} {limit:>6.3f} {cells} {limit / statistics.median(res['hf_moe']):>8.2f}")


if __name__ == "__main__":
    main()
