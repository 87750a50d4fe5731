"""Where a decode step's time goes: a whole one-token step, eager (dynamic cache) and compiled (the fast decode path:
static cache, decode step compiled once), beside the kernels it is made of, each timed alone at the model's shapes.

    python benchmarks/decode_profile.py --model smollm2-moe-work/smollm2-moe-8x-top2 [--dtype bf16] [--threads 2]

Steps: the median over --steps one-token steps after a 40-token prompt, the modes interleaved step by step.
Kernels: each timed alone (median of --repeats calls) on the first layer's weights, times the calls a step makes:
the attention projections (q, k, v, o: 4 products per layer), the router, the experts (hf_moe's op, one token, its
k experts), attention itself (scaled_dot_product_attention over a 64-position cache), and the LM head. What a step
takes beyond their sum is everything else: norms, rotary embeddings, residual adds, cache updates, the sampling's
argmax, Python and dispatch. The weights a step reads over its time give the effective bandwidth (a decode step
is bound by reading its weights; llama.cpp's step on the same machine is the yardstick: benchmarks/serve_cpu.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def step_bytes(model) -> int:
    """Bytes of the weights one decode token reads: all but the experts and the input embedding (one row; read whole
    as the LM head when tied), plus k experts per MoE layer."""
    from hf_moe.routing import moe_blocks

    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    if head is None or head.weight is not emb:
        total -= emb.numel() * emb.element_size()
    for block in moe_blocks(model):
        per_expert = sum(p.numel() * p.element_size() for p in block.experts.parameters()) // block.experts.num_experts
        total += per_expert * model.config.num_experts_per_tok
    return total


def kernels(model, repeats: int) -> dict[str, float]:
    """{kernel: ms per decode step} (one call's median times the calls per step)."""
    from hf_moe.routing import moe_blocks

    config = model.config
    layers = config.num_hidden_layers
    layer = model.model.layers[0]
    attn = layer.self_attn
    block = moe_blocks(model)[0]
    x = torch.randn(1, config.hidden_size, dtype=model.dtype)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q = torch.randn(1, heads, 1, head_dim, dtype=model.dtype)
    k = torch.randn(1, kv_heads, 64, head_dim, dtype=model.dtype)
    routing = block.gate(x)
    index, weights = routing.dispatch_index(), routing.top_k_weights
    projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
    return {
        "attention projections": layers * sum(median_ms(lambda m=m: m(x), repeats) for m in projections),
        "router": layers * median_ms(lambda: block.gate(x), repeats),
        "experts": layers * median_ms(lambda: block.experts(x, index, weights), repeats),
        "attention": layers * median_ms(
            lambda: F.scaled_dot_product_attention(q, k, k, enable_gqa=heads != kv_heads), repeats),
        "LM head": median_ms(lambda: model.lm_head(x), repeats),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--modes", default="eager,compiled")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import DynamicCache, StaticCache

    import hf_moe

    model = hf_moe.MoEForCausalLM.from_pretrained(args.model, dtype={"fp32": torch.float32,
                                                                     "bf16": torch.bfloat16}[args.dtype]).eval()
    prompt = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    compiled = None
    if "compiled" in args.modes:
        from hf_moe.generation import MIN_CACHE_LEN, decode_compile_config

        assert prompt.shape[1] + args.steps + 20 <= MIN_CACHE_LEN
        compiled = torch.compile(model.__call__, **decode_compile_config().to_dict())
    states = {}
    with torch.inference_mode():
        for mode in args.modes.split(","):
            if mode == "eager":
                cache, forward = DynamicCache(config=model.config), model.__call__
            else:
                cache, forward = StaticCache(config=model.config, max_cache_len=MIN_CACHE_LEN), compiled
            out = model(prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(prompt.shape[1]))
            states[mode] = {"forward": forward, "cache": cache, "token": out.logits[:, -1:].argmax(-1),
                            "position": prompt.shape[1], "times": []}

        def step(state) -> float:
            start = time.perf_counter()
            out = state["forward"](input_ids=state["token"], past_key_values=state["cache"], use_cache=True,
                                   cache_position=torch.tensor([state["position"]]))
            state["token"] = out.logits[:, -1:].argmax(-1)
            state["position"] += 1
            return time.perf_counter() - start

        start = time.perf_counter()
        for _ in range(10):  # warm-up; the compiled mode compiles on its first step
            for state in states.values():
                step(state)
        warm = time.perf_counter() - start
        for _ in range(args.steps):
            for state in states.values():
                state["times"].append(step(state))
        parts = kernels(model, args.repeats)

    nbytes = step_bytes(model)
    total = sum(parts.values())
    print(f"{type(model).__name__} ({model.config.num_hidden_layers} layers), {args.dtype}, {args.threads} threads, "
          f"torch {torch.__version__}. A step reads {nbytes / 2**20:,.0f} MiB of weights. Steps: median of "
          f"{args.steps}, modes interleaved (warm-up {warm:.0f}s, compilation included).\n")
    print("| mode | step ms | tok/s | GB/s of weights | the kernels below, summed | everything else |")
    print("|---|---|---|---|---|---|")
    for mode, state in states.items():
        median = statistics.median(state["times"]) * 1e3
        print(f"| {mode} | {median:.1f} | {1e3 / median:.1f} | {nbytes / median / 1e6:.1f} | {total:.1f} | "
              f"{median - total:.1f} |")
    print("\n| kernel (timed alone, x calls per step) | ms per step | share of the kernels |\n|---|---|---|")
    for name, ms in parts.items():
        print(f"| {name} | {ms:.2f} | {100 * ms / total:.0f}% |")
    print(f"| all kernels | {total:.2f} | {nbytes / total / 1e6:.1f} GB/s of weights |")


if __name__ == "__main__":
    main()
