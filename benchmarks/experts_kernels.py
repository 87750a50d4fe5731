"""Speed of the experts kernels alone, at the quickstart model's shapes: fp32, bf16 and int8 weights, ours and torch's.

    flock /tmp/hf_moe_heavy.lock python benchmarks/experts_kernels.py [--tokens 1 4 128 512] [--repeats 9]
    python benchmarks/experts_kernels.py --smoke          # tiny, 2 repeats: that the script runs

Shapes: SmolLM2-135M converted as examples/smollm2_moe.py does it: hidden 576, expert intermediate 1536, 8 experts,
top-2, 30 MoE layers. Every layer has its own weights (as in the model), so a pass over the layers reads its
weights from memory, not from the CPU caches: a one-token decode step streams 2 experts x 30 layers (318 MB in
bf16, 636 MB in fp32, 159 MB in int8), which is what bounds decoding. Routing is uniform random, top-2.

Contestants, one MoE layer call each (the experts only: no router, no attention), interleaved in every repeat:
  torch fp32      hf_moe's whole-layer training op (moe_experts_forward: ATen GEMMs, MKL) on fp32 weights: the path
                  hf_moe ran before the inference kernel
  torch bf16      the same on bf16 weights: torch's own bf16 matmul (oneDNN)
  ours fp32       moe_experts_infer on fp32 weights (csrc/cpu/infer_cpu.cpp)
  ours bf16       moe_experts_infer on bf16 weights and activations: vdpbf16ps, fp32 accumulation
  ours int8/bf16  moe_experts_infer on int8 weights (per-channel scales), bf16 activations
  ours int8/fp32  moe_experts_infer on int8 weights, fp32 activations
  ours portable   moe_experts_infer's portable C++ kernels, bf16 (what CPUs without AVX-512 BF16 run), 1-4 tokens

Every repeat calls each contestant once per layer, back to back (call i of every contestant ran within a few
milliseconds of the others, in an order that rotates; each on another layer, so none finds weights another just
read in the caches). Printed per token count and thread count: milliseconds per layer call (median [20th-80th
percentile], and the minimum: on a shared machine the least disturbed call), the ratio of torch fp32's time to
each contestant's in the same repeat and step (higher is faster; median [p20-p80] of the pairs), and the rate:
GB/s of expert weights read for decode sizes, GFLOP/s for prefill sizes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spread import cell  # noqa: E402  (benchmarks/spread.py)

from hf_moe.ops import load_extension  # noqa: E402
from hf_moe.ops.int8 import quantize_int8  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 576, 1536, 8, 2, 30


def build_layers(layers: int, hidden: int, inter: int, experts: int, seed: int = 0) -> list[dict]:
    """Per layer: {weight kind: (w1, w1_scale, w2, w2_scale)} for fp32, bf16 and int8 (per-channel scales)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        w1 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02
        w2 = torch.randn(experts, hidden, inter, generator=g) * 0.02
        q1, s1 = quantize_int8(w1)
        q2, s2 = quantize_int8(w2)
        out.append({"fp32": (w1, None, w2, None), "bf16": (w1.bfloat16(), None, w2.bfloat16(), None),
                    "int8": (q1, s1, q2, s2)})
    return out


# name -> (weight kind, activation dtype, implementation)
CONTESTANTS = {
    "torch fp32": ("fp32", torch.float32, "whole"),
    "torch bf16": ("bf16", torch.bfloat16, "whole"),
    "ours fp32": ("fp32", torch.float32, "auto"),
    "ours bf16": ("bf16", torch.bfloat16, "auto"),
    "ours int8/bf16": ("int8", torch.bfloat16, "auto"),
    "ours int8/fp32": ("int8", torch.float32, "auto"),
    "ours portable": ("bf16", torch.bfloat16, "portable"),
}
BASELINE = "torch fp32"


def calls(layers, kind, dtype, impl, tokens, hidden, experts, top_k, seed):
    """call(l): one layer call on layer l's weights for `tokens` tokens (a fixed random routing per layer)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    routes = [torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) for _ in layers]
    weights = torch.rand(tokens, top_k, generator=g)
    ops = torch.ops.hf_moe

    def call(l: int) -> None:
        w1, s1, w2, s2 = layers[l][kind]
        if impl == "whole":
            ops.moe_experts_forward(x, routes[l], weights.to(dtype), w1, None, w2, None, "silu", True, False)
        else:
            ops.moe_experts_infer(x, routes[l], weights, w1, s1, None, w2, s2, None, "silu", True, impl)

    return call


def active_bytes(layer: dict, kind: str, tokens: int, experts: int, top_k: int) -> float:
    """Expected bytes of expert weights one layer reads for `tokens` tokens routed uniformly at random."""
    per_expert = sum(t.numel() * t.element_size() for t in layer[kind] if t is not None) / experts
    untouched = (1 - top_k / experts) ** tokens  # probability that a given expert gets no token
    return per_expert * experts * (1 - untouched)


def measure(layers, names, tokens, repeats, hidden, experts, top_k) -> dict[str, list[float]]:
    """{contestant: [ms of each layer call]}, paired: call i of every contestant ran back to back (in an order that
    rotates), each on another layer, so no contestant finds weights another just read in the CPU caches."""
    n = len(layers)
    run = {c: calls(layers, *CONTESTANTS[c], tokens, hidden, experts, top_k, seed=tokens) for c in names}
    times = {c: [] for c in names}
    with torch.inference_mode():
        for c in names:  # warm-up: first-call allocations, thread pools
            run[c](0)
        for rep in range(repeats):
            for step in range(n):
                order = names[rep % len(names):] + names[: rep % len(names)]
                for c in order:
                    layer = (step + 7 * names.index(c)) % n
                    start = time.perf_counter()
                    run[c](layer)
                    times[c].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 128, 512])
    p.add_argument("--repeats", type=int, default=9, help="passes over the layers")
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 repeats: that the script runs")
    args = p.parse_args()
    hidden, inter, experts, top_k, layers_n = HIDDEN, INTER, EXPERTS, TOP_K, args.layers
    if args.smoke:
        hidden, inter, layers_n, args.repeats, args.tokens = 64, 96, 2, 2, [1, 16]
    module, status = load_extension()
    if module is None:
        sys.exit(f"the compiled extension is unavailable ({status.how}); nothing to measure")
    print(f"experts kernels: hidden {hidden}, intermediate {inter}, {experts} experts, top-{top_k}, {layers_n} layers; "
          f"kernels: {torch.ops.hf_moe.infer_isa()}; torch {torch.__version__}; load average "
          f"{', '.join(f'{v:.1f}' for v in os.getloadavg())} on {os.cpu_count()} CPUs")
    layers = build_layers(layers_n, hidden, inter, experts)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for tokens in args.tokens:
            names = [n for n in CONTESTANTS if not (CONTESTANTS[n][2] == "portable" and tokens > 4)]
            times = measure(layers, names, tokens, args.repeats, hidden, experts, top_k)
            calls_n = len(times[BASELINE])
            print(f"\n{tokens} token(s) per layer call ({'decode' if tokens <= 4 else 'prefill'}), {threads} thread(s): "
                  f"ms per layer call, median [p20-p80] and min of {calls_n} calls; ratio {BASELINE} time / "
                  "time of the call that ran beside it, median [p20-p80]")
            print(f"{'contestant':<16} {'ms / layer':>22} {'min':>7} {'vs ' + BASELINE:>22} {'rate (median)':>15}")
            for n in names:
                ratios = [b / t for b, t in zip(times[BASELINE], times[n])]
                ms = statistics.median(times[n])
                kind = CONTESTANTS[n][0]
                if tokens <= 4:
                    rate = f"{active_bytes(layers[0], kind, tokens, experts, top_k) / ms / 1e6:.1f} GB/s"
                else:
                    rate = f"{2 * 3 * hidden * inter * tokens * top_k / ms / 1e6:.0f} GFLOP/s"
                print(f"{n:<16} {cell(times[n], 3):>22} {min(times[n]):>7.3f} {cell(ratios, 2):>22} {rate:>15}")


if __name__ == "__main__":
    main()
