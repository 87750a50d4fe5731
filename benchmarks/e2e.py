"""End to end: prefill and decode tokens/s of a saved hf_moe model against the same model exported to transformers'
native MoE architecture (Mixtral for a Llama base), on transformers' `eager` and `grouped_mm` experts.

    python benchmarks/e2e.py --model smollm2-moe-work/smollm2-moe-8x-top2 [--prompt-tokens 128] [--new-tokens 32]
                             [--repeats 9] [--workdir e2e-work]

The model is the quickstart's (examples/quickstart.sh writes it). It is exported once with `hf_moe.export_native`
into --workdir, and the native model loads with plain transformers. Contestants, one process, all fp32:

    hf_moe               MoEForCausalLM, on the default backend (the compiled C++ ops on CPU)
    native eager         MixtralForCausalLM, experts_implementation="eager" (transformers' loop over experts)
    native grouped_mm    MixtralForCausalLM, experts_implementation="grouped_mm"

Each repeat runs every contestant once, in turn (interleaved, so load on a shared machine hits them alike): a
prefill of --prompt-tokens tokens (one forward filling the KV cache, with the last position's logits only, as
`generate` does), then --new-tokens greedy decode steps, each a
forward of one token with the cache. The same prompt for all; the greedy tokens are checked equal.

Printed: tokens/s, median [20th-80th percentile] over the repeats, and hf_moe's speed over each native run's, per
repeat, median [20th-80th percentile]. Ratios are what to read; absolute speed on a shared machine is noise.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM

import hf_moe
from hf_moe.compat import cache_kwargs, output_cache
from spread import cell  # benchmarks/spread.py


def greedy(model, prompt, new_tokens):
    """(prefill s, decode s, generated ids [new_tokens]) of a KV-cached greedy run on `prompt` [1, P]."""
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(prompt, use_cache=True, logits_to_keep=1)  # as generate() does: the last position's logits
        prefill = time.perf_counter() - start
        past, token, generated = output_cache(out), out.logits[:, -1:].argmax(-1), []
        start = time.perf_counter()
        for _ in range(new_tokens):
            generated.append(token)
            out = model(token, **cache_kwargs(past), use_cache=True)
            past, token = output_cache(out), out.logits[:, -1:].argmax(-1)
        decode = time.perf_counter() - start
    return prefill, decode, torch.cat(generated, dim=1)[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a directory saved by hf_moe (the quickstart's MoE model)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--workdir", default="e2e-work", help="where the native export is written (once)")
    args = parser.parse_args()
    if args.prompt_tokens < 1 or args.new_tokens < 1 or args.repeats < 1:
        parser.error("--prompt-tokens, --new-tokens and --repeats must be at least 1")

    ours = hf_moe.MoEForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    native_dir = os.path.join(args.workdir, "native")
    if not os.path.isfile(os.path.join(native_dir, "config.json")):
        print(f"exporting {args.model} to {native_dir} ...", flush=True)
        hf_moe.export_native(ours, native_dir)
    native = AutoModelForCausalLM.from_pretrained(native_dir, dtype=torch.float32).eval()
    contestants = {"hf_moe": (ours, None), "native eager": (native, "eager"),
                   "native grouped_mm": (native, "grouped_mm")}

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, ours.config.vocab_size, (1, args.prompt_tokens), generator=generator)
    times = {name: ([], []) for name in contestants}  # tokens/s: prefill, decode
    tokens = {}
    for repeat in range(args.repeats + 1):  # the first is a warm-up
        for name, (model, impl) in contestants.items():
            if impl is not None:
                model.set_experts_implementation(impl)
            prefill, decode, ids = greedy(model, prompt, args.new_tokens)
            tokens.setdefault(name, ids)
            if repeat:
                times[name][0].append(args.prompt_tokens / prefill)
                times[name][1].append(args.new_tokens / decode)
        print(f"repeat {repeat}/{args.repeats} done", flush=True)
    same = all(torch.equal(ids, tokens["hf_moe"]) for ids in tokens.values())

    print(f"\n{type(ours).__name__} ({ours.config.num_experts} experts, top-{ours.config.num_experts_per_tok}, "
          f"{ours.config.num_hidden_layers} layers) vs {type(native).__name__}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, fp32, prompt {args.prompt_tokens} tokens, {args.new_tokens} greedy "
          f"decode steps, {args.repeats} repeats (+1 warm-up). Greedy tokens equal: {same}.")
    print("tokens/s median [20th-80th percentile]; hf_moe / this: per-repeat ratio, median [20th-80th percentile]\n")
    widths = (18, 20, 18, 20, 18)
    titles = ("contestant", "prefill tok/s", "hf_moe / this", "decode tok/s", "hf_moe / this")
    print("| " + " | ".join(f"{t:<{w}}" if i == 0 else f"{t:>{w}}" for i, (t, w) in enumerate(zip(titles, widths)))
          + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for name in contestants:
        cells = []
        for slot in (0, 1):
            ratios = [a / b for a, b in zip(times["hf_moe"][slot], times[name][slot])]
            cells += [cell(times[name][slot], 1).strip(), cell(ratios, 2).strip()]
        print(f"| {name:<18} | {cells[0]:>20} | {cells[1]:>18} | {cells[2]:>20} | {cells[3]:>18} |")


if __name__ == "__main__":
    main()
