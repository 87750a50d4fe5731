"""Where a decode step's time goes: whole one-token steps of every way hf_moe can run them, side by side, and the
kernels a step is made of, each timed alone at the model's shapes.

    python benchmarks/decode_profile.py --model smollm2-moe-work/smollm2-moe-8x-top2 [--dtype bf16] [--threads 2]
    python benchmarks/decode_profile.py --model ... --int8 experts|all       # int8 experts (and linear layers)

Steps: the median over --steps one-token steps after a 40-token prompt, each mode on its own static cache (eager:
transformers' default dynamic cache), the modes interleaved step by step (so load on a shared machine hits them
alike). Modes:

    eager          transformers' forward, not compiled
    compiled       transformers' forward under torch.compile (fullgraph, static shapes), inductor's defaults
    cpp_wrapper    the same with inductor's C++ wrapper (the kernels called from one C++ function)
    freezing       weights folded into the graph as constants and prepacked for oneDNN
    max_autotune   freezing, plus inductor's CPU GEMM templates (benchmarked against ATen's at compile time)
    hf_moe_step    hf_moe's decode step (hf_moe.decode): one call of the model's plan where the model allows it
                   (hf_moe.decode_one_op), else the attention-block step compiled with hf_moe's default options (the
                   C++ wrapper)
    attention_block  the attention-block step compiled, where hf_moe_step would be one op call (one_op=False)
    attention_block_python  the attention-block step with inductor's Python wrapper
    attention_block_checked  the attention-block step with Dynamo's guards checked on every step
                   (attention_block: on the first step only); with attention_block in the same run, the same
                   compiled program
    aoti           the attention-block step exported (torch.export) and compiled ahead of time by AOTInductor into
                   a package, loaded and run from C++ (torch._inductor.aoti_load_package)
(before these names: fused, fused_compiled, fused_python, fused_checked, still accepted with a warning)

Kernels: each timed alone, the median of --repeats passes that call it once per layer on each layer's own weights
(as a step does: the weights come from memory, not from a cache one layer's weights would fit in).
The attention sub-block as one op (hf_moe::decode_attention_block) beside the transformers ops it replaces run one by
one, the router, the experts (hf_moe's op, one token, its k experts), the final norm and the LM head (ATen's GEMM and
hf_moe::linear_infer). What a step takes beyond the sum of a mode's kernels is everything else: the embedding, the
rotary embedding's cos/sin, residual adds, the cache length updates, and the dispatch between kernels. The weights a
step reads over its time give the effective bandwidth (a decode step is bound by reading its weights; llama.cpp's
step on the same machine is the yardstick: benchmarks/serve_cpu.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from decode_modes import MODES, mode_names  # noqa: E402  (benchmarks/: the compiled modes and their settings)


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

    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    total = sum(t.numel() * t.element_size() for n, t in tensors.items() if ".experts." not in n)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    if getattr(head, "weight", None) is not emb:
        total -= emb.numel() * emb.element_size()
    for block in moe_blocks(model):
        experts = block.experts
        per_expert = sum(t.numel() * t.element_size() for t in [*experts.parameters(), *experts.buffers()])
        total += per_expert // experts.num_experts * model.config.num_experts_per_tok
    return total


# ------------------------------------------------------------------------------------------------------------ steps
class Mode:
    """One way of running decode steps, on a cache of its own."""

    def __init__(self, name: str, model, prompt: torch.Tensor, cache_len: int, programs: dict | None = None):
        """`programs`: {inductor options: compiled attention-block step}, shared by the hf_moe modes of a run, so
        that attention_block and attention_block_checked run one compiled program (one Dynamo cache entry) and
        differ only in the guards checked."""
        from transformers import DynamicCache, StaticCache

        from hf_moe.compat import cache_kwargs, static_cache_layers

        self.name, self.model, self.times = name, model, []
        self.cache = DynamicCache(config=model.config) if name == "eager" else \
            StaticCache(config=model.config, max_cache_len=cache_len)
        out = model(prompt, use_cache=True, **cache_kwargs(self.cache))
        self.token = out.logits[:, -1:].argmax(-1)
        self.position = prompt.shape[1]
        self.mask = torch.zeros(1, cache_len, dtype=torch.bool)
        self.mask[:, :self.position] = True
        self.cache_kwargs = cache_kwargs(self.cache)
        self.static_layers = static_cache_layers
        self.programs = {} if programs is None else programs
        self.run = self._build()

    def _build(self):
        from hf_moe.decode import DecodeStep
        from hf_moe.generation import DECODE_OPTIONS, decode_compile_config

        if self.name == "eager":
            return lambda: self.model(self.token, position_ids=self._positions(), use_cache=True,
                                      **self.cache_kwargs).logits
        if self.name == "aoti":
            return self._aoti()
        settings = MODES[self.name]
        options = DECODE_OPTIONS if settings.get("options") is None else settings["options"]
        if settings["hf_moe_step"]:  # as generate calls it: its guards checked on the first step, skipped after
            config = decode_compile_config(options=options, skip_guards=settings.get("skip_guards", True),
                                           one_op=settings.get("one_op", True))
            step = DecodeStep(self.model, config, None)
            step.compiled = self.programs.setdefault(repr(sorted((options or {}).items())), step.compiled)
            return lambda: step(input_ids=self.token, position_ids=self._positions(),
                                attention_mask=self._mask()[:, None, None], **self.cache_kwargs).logits
        forward = torch.compile(self.model.__call__, fullgraph=True, dynamic=False, options=options or None)
        return lambda: forward(self.token, position_ids=self._positions(), attention_mask=self._mask()[:, None, None],
                               use_cache=True, **self.cache_kwargs).logits

    def _aoti(self):
        """The attention-block step through torch.export and AOTInductor: a package on disk, loaded back and run."""
        from hf_moe.decode import DecodeStep
        from hf_moe.generation import decode_compile_config

        step = DecodeStep(self.model, decode_compile_config(), fallback=None)
        layers = self.static_layers(self.cache)

        class Step(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, token, positions, mask, keys, values, lengths):
                return step.forward(token, positions, mask, list(zip(keys, values, lengths)))

        keys, values, lengths = ([layer[i] for layer in layers] for i in range(3))
        args = (self.token, self._positions(), self._mask(), keys, values, lengths)
        program = torch.export.export(Step(self.model), args, strict=False)
        path = os.path.join(tempfile.mkdtemp(prefix="hf_moe-aoti-"), "decode_step.pt2")
        torch._inductor.aoti_compile_and_package(program, package_path=path)
        runner = torch._inductor.aoti_load_package(path)
        return lambda: runner(self.token, self._positions(), self._mask(), keys, values, lengths)

    def _positions(self) -> torch.Tensor:
        return torch.tensor([[self.position]])

    def _mask(self) -> torch.Tensor:
        self.mask[:, self.position] = True  # this token's own position
        return self.mask

    def step(self) -> float:
        start = time.perf_counter()
        logits = self.run()
        self.token = logits[:, -1:].argmax(-1)
        self.position += 1
        return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------- kernels
def kernels(model, repeats: int) -> dict[str, float]:
    """{kernel: ms per decode step}: the median of `repeats` passes, each calling the kernel once per layer on that
    layer's own weights, as a step does (so that the weights come from memory, not from a cache that one layer's
    would fit in: one layer's two bf16 experts are 10 MB, the L3 cache of the machine measured 32 MB)."""
    from hf_moe.layers.quantized_linear import linear_weights
    from hf_moe.ops.decode import rms_norm, rotary
    from hf_moe.routing import moe_blocks

    config = model.config
    backbone = model.model
    layers = list(backbone.layers)
    blocks = moe_blocks(model)
    dtype = layers[0].input_layernorm.weight.dtype
    x = torch.randn(1, config.hidden_size, dtype=dtype)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    keys = torch.randn(1, kv_heads, 256, d, dtype=dtype)  # a static cache of 256 positions, 64 written
    values = torch.randn_like(keys)
    position = torch.tensor(64)
    mask = (torch.arange(256) <= 64)[None]
    cos, sin = torch.ones(1, d, dtype=dtype), torch.zeros(1, d, dtype=dtype)
    q = torch.randn(1, heads, 1, d, dtype=dtype)
    routings = [block.gate(x) for block in blocks]
    dispatch = [(r.dispatch_index(), r.top_k_weights) for r in routings]

    def block_as_one_op(layer):
        attn = layer.self_attn
        torch.ops.hf_moe.decode_attention_block(
            x, layer.input_layernorm.weight, 1e-5, *linear_weights(attn.q_proj), *linear_weights(attn.k_proj),
            *linear_weights(attn.v_proj), *linear_weights(attn.o_proj), None, None, 1e-6, cos, sin, keys, values,
            position, mask, attn.scaling, layer.post_attention_layernorm.weight, 1e-5)

    def block_op_by_op(layer):  # transformers' ops, one by one (eager)
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        qs = attn.q_proj(h).view(1, heads, 1, d)
        ks = attn.k_proj(h).view(1, kv_heads, 1, d)
        vs = attn.v_proj(h).view(1, kv_heads, 1, d)
        qs, ks = rotary(qs, cos, sin), rotary(ks, cos, sin)
        keys.index_copy_(2, position[None], ks)
        values.index_copy_(2, position[None], vs)
        a = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask[:, None, None], enable_gqa=True)
        out = x + attn.o_proj(a.reshape(1, -1))
        return rms_norm(out, layer.post_attention_layernorm.weight, 1e-5)

    def projections(layer):
        attn = layer.self_attn
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            m(x)

    def per_step(fn, items):
        return lambda: [fn(item) for item in items]

    # Every layer's q/k/v/o rows in one matrix, read by one linear_infer call: the same bytes as the projections of a
    # step in one stream, the rate the attention sub-block would read its weights at with no per-layer start and stop.
    projection_weights = [linear_weights(m) for layer in layers for m in
                          (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.self_attn.o_proj)]
    stacked = None
    if all(scale is None and bias is None for _, scale, bias in projection_weights):
        stacked = torch.cat([weight for weight, _, _ in projection_weights])
    head = model.lm_head
    head_weight, head_scale, head_bias = linear_weights(head)
    parts = {
        "attention sub-block, transformers' ops one by one": median_ms(per_step(block_op_by_op, layers), repeats),
        "  of which the q/k/v/o projections (ATen)": median_ms(per_step(projections, layers), repeats),
        "  of which attention (SDPA over a 256-position static cache)": len(layers) * median_ms(
            lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None], enable_gqa=True),
            repeats),
        "attention sub-block, hf_moe::decode_attention_block": median_ms(per_step(block_as_one_op, layers), repeats),
        "  its q/k/v/o weights, each layer's one linear_infer call at a time": median_ms(
            per_step(lambda w: torch.ops.hf_moe.linear_infer(x, *w), projection_weights), repeats),
        **({} if stacked is None else {  # (not for int8 projections: their scales differ by layer)
            "  its q/k/v/o weights of every layer, one linear_infer call": median_ms(
                lambda: torch.ops.hf_moe.linear_infer(x, stacked, None, None), repeats)}),
        "router": median_ms(per_step(lambda block: block.gate(x), blocks), repeats),
        "experts (hf_moe::moe_experts_infer)": median_ms(
            per_step(lambda i: blocks[i].experts(x, *dispatch[i]), range(len(blocks))), repeats),
        "final norm": median_ms(lambda: backbone.norm(x), repeats),
        "LM head, hf_moe::linear_infer": median_ms(
            lambda: torch.ops.hf_moe.linear_infer(x, head_weight, head_scale, head_bias), repeats),
    }
    if head_scale is None:
        parts["LM head, ATen (F.linear)"] = median_ms(lambda: F.linear(x, head_weight, head_bias), repeats)
    return parts


STEP_PARTS = ("attention sub-block, hf_moe::decode_attention_block", "router", "experts (hf_moe::moe_experts_infer)",
              "final norm", "LM head, hf_moe::linear_infer")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--int8", choices=["experts", "all"], help="int8 experts (all: and the other linear layers)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--modes", default="eager,compiled,cpp_wrapper,hf_moe_step",
                   help=f"eager, aoti, {', '.join(MODES)} (fused, fused_*: their former names)")
    p.add_argument("--cache-len", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import hf_moe

    model = hf_moe.MoEForCausalLM.from_pretrained(args.model, dtype={"fp32": torch.float32,
                                                                     "bf16": torch.bfloat16}[args.dtype]).eval()
    if args.int8:
        hf_moe.quantize_experts(model, "int8", linears=args.int8 == "all")
    prompt = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    assert prompt.shape[1] + args.steps + 20 <= args.cache_len
    modes, warm, programs = [], {}, {}
    with torch.inference_mode():
        for name in mode_names(args.modes):
            start = time.perf_counter()
            try:
                mode = Mode(name, model, prompt, args.cache_len, programs)
                for _ in range(5):  # warm-up; the compiled modes compile on their first step
                    mode.step()
            except Exception as err:  # a way that cannot run here: said, and left out
                print(f"NOTE: {name} left out: {type(err).__name__}: {str(err)[:1500]}", file=sys.stderr, flush=True)
                continue
            warm[name] = time.perf_counter() - start
            modes.append(mode)
        for _ in range(args.steps):
            for mode in modes:
                mode.times.append(mode.step())
        parts = kernels(model, args.repeats)

    nbytes = step_bytes(model)
    summed = sum(parts[k] for k in STEP_PARTS)
    print(f"{type(model).__name__} ({model.config.num_hidden_layers} layers), {args.dtype}"
          f"{', int8 ' + args.int8 if args.int8 else ''}, {args.threads} threads, torch {torch.__version__}, load "
          f"average {os.getloadavg()[0]:.1f}. A step reads {nbytes / 2**20:,.0f} MiB of weights. Steps: median "
          f"[20th-80th percentile] of {args.steps}, modes interleaved.\n")
    print("| mode | step ms | tok/s | GB/s of weights | vs eager | first steps s (compilation) |")
    print("|---|---|---|---|---|---|")
    eager = statistics.median(modes[0].times) if modes and modes[0].name == "eager" else None
    for mode in modes:
        q = statistics.quantiles(mode.times, n=5)
        median = statistics.median(mode.times)
        print(f"| {mode.name} | {median * 1e3:.2f} [{q[0] * 1e3:.2f}-{q[-1] * 1e3:.2f}] | {1 / median:.1f} | "
              f"{nbytes / median / 1e9:.1f} | {f'{eager / median:.2f}x' if eager else '-'} | {warm[mode.name]:.0f} |")
    print("\n| kernel (timed alone, each layer's own weights) | ms per step |\n|---|---|")
    for name, ms in parts.items():
        print(f"| {name} | {ms:.2f} |")
    print(f"| the attention-block step's kernels, summed | {summed:.2f} "
          f"({nbytes / summed / 1e6:.1f} GB/s of weights) |")


if __name__ == "__main__":
    main()
