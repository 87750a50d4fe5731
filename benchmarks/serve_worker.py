"""One Hugging Face contestant of benchmarks/serve_cpu.py, in a process of its own (so that its peak RSS is its own):
a model loaded once, commands as JSON lines on stdin, one answer each on stdout after "@@ " (the protocol of
benchmarks/llamacpp_bench.mjs, whose commands it shares).

    python benchmarks/serve_worker.py --engine hf_moe|native --model DIR --precision fp32|bf16|int8 --threads 2

    hf_moe   MoEForCausalLM.from_pretrained(DIR, dtype=...); int8: hf_moe.quantize_experts(model, "int8") after
    native   AutoModelForCausalLM.from_pretrained(DIR, dtype=...): transformers' own architecture (the export), with
             its default experts implementation unless --experts-implementation says otherwise

Commands (each generate/nll on a fresh cache):
    {"op": "info"}
    {"op": "generate", "prompt": [ids], "new_tokens": N, "stop_at_eos": bool, "mode": one of MODES}
        -> {"tokens": [...], "times": [0, t_1, ..., t_N]}: seconds from the call to each new token's arrival
           (greedy; unless stop_at_eos, `eos_token_id=None`: EOS is a token like any other and decoding goes on,
           as on llama.cpp's side). eager: generate's default dynamic cache. Every other
           mode: hf_moe.generation.fast_decode_kwargs(), the static cache with the decode step compiled once (the
           prefill stays eager, as transformers runs it), as long as `hf_moe.generation` makes it for hf_moe models
           (the need, in a power of two, at least 256), for both engines, with MODES' settings:
             compiled      transformers' decode step, inductor's defaults (Python calls each kernel)
             cpp_wrapper   transformers' decode step, inductor's C++ wrapper (one C++ function calls the kernels)
             freezing      transformers' decode step, weights folded as constants and prepacked for oneDNN
             max_autotune  freezing, plus inductor's CPU GEMM templates benchmarked against ATen's
             hf_moe_step   hf_moe's decode step (hf_moe.decode): one call of the model's plan where the model
                           allows it (hf_moe.decode_one_op), else the attention-block step compiled with hf_moe's
                           default options (the C++ wrapper); transformers' own models ignore it and run
                           `cpp_wrapper`
             attention_block  the attention-block step compiled (`one_op=False`), where hf_moe_step would be one
                           op call
             attention_block_python  the attention-block step with inductor's Python wrapper
             attention_block_checked  the attention-block step with Dynamo's guards checked on every step
                           (`skip_guards=False`; attention_block checks them on each call's first step only)
           (before these names: fused, fused_compiled, fused_python, fused_checked; benchmarks/decode_modes.py)
    {"op": "nll", "tokens": [ids]} -> {"nll": sum of -log p(token i | tokens < i) for i >= 1, "count"}
    {"op": "rss"} -> {"peak_rss": VmHWM bytes, "rss": VmRSS bytes}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16, "int8all": torch.bfloat16}
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_modes import MODES  # noqa: E402  (benchmarks/: mode -> decode_compile_config's arguments)


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class Timestamps:
    """A `generate` streamer: the time of every `put` after the first (the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def load(args):
    import hf_moe  # noqa: F401  (registers the hf_moe model type)
    from transformers import AutoModelForCausalLM

    dtype = PRECISIONS[args.precision]
    if args.engine == "hf_moe":
        kwargs = {}
        if args.offload_experts:  # hf_moe's expert cache (benchmarks/offload.py)
            kwargs = dict(offload_experts=args.offload_experts, max_expert_memory=args.max_expert_memory,
                          offload_prefetch=args.offload_prefetch == "on")
        elif args.accelerate_max_memory:  # accelerate's offload: whole modules on disk, loaded at every forward
            os.makedirs(args.offload_folder, exist_ok=True)
            kwargs = dict(device_map="auto", max_memory={"cpu": args.accelerate_max_memory},
                          offload_folder=args.offload_folder)
        model = hf_moe.MoEForCausalLM.from_pretrained(args.model, dtype=dtype, **kwargs)
        if args.precision.startswith("int8"):  # int8all: the attention, dense layers and LM head too
            hf_moe.quantize_experts(model, "int8", linears=args.precision == "int8all")
    else:
        kwargs = {"experts_implementation": args.experts_implementation} if args.experts_implementation else {}
        if args.precision.startswith("int8"):
            raise SystemExit("int8: transformers' native MoE models have no int8 experts (torchao and quanto "
                             "quantize nn.Linear only)")
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **kwargs)
    return model.eval()


def generate(model, prompt, new_tokens, stop_at_eos, mode, pad_token_id):
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad_token_id,
                  attention_mask=torch.ones_like(ids))
    if not stop_at_eos:  # as llama.cpp's side does: EOS is generated like any token, and decoding goes on past it
        kwargs["eos_token_id"] = None
    if mode in MODES:  # the fast decode path: cache length the call's need, a power of two (>= 256)
        from hf_moe.generation import cache_length, fast_decode_kwargs

        kwargs.update(fast_decode_kwargs(max_cache_len=cache_length(ids.shape[1] + new_tokens), **MODES[mode]))
    elif mode != "eager":
        raise ValueError(f"mode must be eager or one of {', '.join(MODES)}, got {mode!r}")
    streamer = Timestamps()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, streamer=streamer, **kwargs)
    return {"tokens": out[0, ids.shape[1]:].tolist(), "times": [0.0] + [t - start for t in streamer.times]}


def nll(model, tokens):
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        logits = model(ids, use_cache=False).logits[0, :-1].float()  # [T-1, V]
        logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])
    return {"nll": float(-logp.sum()), "count": len(tokens) - 1}


def cache_report(model, reset: bool = False) -> dict:
    """hf_moe offload: the cache's stats and routing trace since the last reset (then reset, tracing on)."""
    from hf_moe.offload import expert_cache

    cache = expert_cache(model)
    s = cache.stats
    report = {"hit_rate": s.hit_rate, "prefetch_accuracy": s.prefetch_accuracy, "bytes_read": s.bytes_read,
              "wait_s": s.wait_s, "uses": s.uses, "slots": cache.num_slots, "pool_bytes": cache.pool_bytes(),
              "policy": cache.policy.name, "prefetch": cache.prefetch, "trace": cache.trace}
    if reset:
        s.reset()
        cache.trace = []
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["hf_moe", "native"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--precision", choices=sorted(PRECISIONS), required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--experts-implementation", help="native only (default: transformers' default)")
    p.add_argument("--offload-experts", choices=["disk", "cpu"], help="hf_moe only: experts offloaded, cached")
    p.add_argument("--max-expert-memory", type=int, help="bytes of the expert cache (with --offload-experts)")
    p.add_argument("--offload-prefetch", choices=["on", "off"], default="off")
    p.add_argument("--accelerate-max-memory", type=int, help="hf_moe only: accelerate's device_map='auto' with "
                   "max_memory={'cpu': this} and the rest offloaded to --offload-folder")
    p.add_argument("--offload-folder")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model = load(args)
    load_s = time.perf_counter() - start
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

    def reply(value) -> None:
        sys.stdout.write("@@ " + json.dumps(value) + "\n")
        sys.stdout.flush()

    reply({"ready": True, "load_s": load_s})
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            break
        try:
            if op == "info":
                import transformers

                experts = getattr(model.config, "_experts_implementation", None)
                answer = {"torch": torch.__version__, "transformers": transformers.__version__,
                          "threads": torch.get_num_threads(), "class": type(model).__name__,
                          "dtype": str(model.dtype), "experts_implementation": experts}
                placement = getattr(model, "hf_device_map", None)
                if placement:  # accelerate's offload: how much of the model it put on disk
                    disk = sum(v == "disk" for v in placement.values())
                    answer["offloaded"] = ("everything on disk" if disk == len(placement)
                                           else f"{disk} of {len(placement)} modules on disk")
            elif op == "generate":
                answer = generate(model, pad_token_id=pad, **command)
            elif op == "nll":
                answer = nll(model, **command)
            elif op == "rss":
                answer = {"peak_rss": status_bytes("VmHWM"), "rss": status_bytes("VmRSS")}
            elif op == "cache":  # the expert cache's counters since the last reset; reset=True starts a trace
                answer = cache_report(model, **command)
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception:  # the parent reports it, with the traceback
            answer = {"error": traceback.format_exc()}
        reply(answer)


if __name__ == "__main__":
    main()
