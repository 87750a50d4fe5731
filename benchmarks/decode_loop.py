"""The one-op decode step in its own loop and inside transformers' loop, side by side (hf_moe.generation).

    python benchmarks/decode_loop.py --model smollm2-moe-work/smollm2-moe-8x-top2 [--int8 all] [--calls 9]

Both loops call the same plan (hf_moe.decode_one_op) once per token on a static cache. `generate`'s plain call runs
it in the step's own loop (`custom_generate=one_op_sample`); transformers' loop (`GenerationMixin._sample`) runs it
as its compiled call (`cache_implementation="static"` and `decode_compile_config(compile=False)`: what the plain
call ran before, and what runs where the own loop cannot), with transformers' per-token work between two steps (the
inputs and mask it prepares, the output object, the forward's dispatch). The two alternate call by call on one
model, so load on a shared machine hits them alike. Each call decodes `--new-tokens` greedy tokens; its step time is
the median time between two streamed tokens. Printed: each loop's step time over the calls (median [20th-80th
percentile]) and the per-call ratio transformers' loop / own loop (higher: the own loop faster), and whether the
two gave the same tokens.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_worker import Timestamps  # noqa: E402  (benchmarks/serve_worker.py)
from spread import cell, median_step  # noqa: E402  (benchmarks/spread.py)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--int8", choices=["experts", "all"], default="all",
                   help="int8 experts (all, the default: and the other linear layers)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=9, help="generate calls per loop, after one warm-up each")
    p.add_argument("--new-tokens", type=int, default=48)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import hf_moe
    from hf_moe.decode import choose_decode
    from hf_moe.generation import decode_compile_config

    model = hf_moe.MoEForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    hf_moe.quantize_experts(model, "int8", linears=args.int8 == "all")
    choice = choose_decode(model, 1)
    if choice.engine != "one_op":
        raise SystemExit(f"the one-op decode step does not run this model: {choice.reason}")
    vocab = model.config.vocab_size
    prompt = torch.randint(3, min(1000, vocab), (1, 40), generator=torch.Generator().manual_seed(0))
    common = {"attention_mask": torch.ones_like(prompt), "do_sample": False, "max_new_tokens": args.new_tokens,
              "min_new_tokens": args.new_tokens, "pad_token_id": 0}
    loops = {
        "own loop (the plain call)": {},
        "transformers' loop": {"cache_implementation": "static",
                               "compile_config": decode_compile_config(compile=False)},
    }
    steps = {name: [] for name in loops}
    tokens = {}
    for call in range(args.calls + 1):
        for name, extra in loops.items():
            stamps = Timestamps()
            with torch.inference_mode():
                out = model.generate(prompt, streamer=stamps, **common, **extra)
            tokens[name] = tuple(out[0].tolist())
            if call:  # the first call of each is a warm-up
                steps[name].append(median_step(stamps.times) * 1e3)
    own, theirs = steps.values()
    ratios = [b / a for a, b in zip(own, theirs)]
    precision = {"experts": "bf16, int8 experts", "all": "bf16, int8 experts and linear layers"}
    print(f"{args.model} ({precision[args.int8]}), {args.threads} threads, torch {torch.__version__}; "
          f"{args.calls} calls of {args.new_tokens} greedy tokens each per loop, alternating; "
          f"load average {os.getloadavg()[0]:.1f} at the end; same tokens: {len(set(tokens.values())) == 1}.\n")
    print("| loop | step ms (median per call) | per-call ratio transformers' loop / own loop |")
    print("|---|---|---|")
    for name, times in steps.items():
        print(f"| {name} | {cell(times, 2)} | {cell(ratios, 3) if times is own else ''} |")


if __name__ == "__main__":
    main()
