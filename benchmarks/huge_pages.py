"""The one-op decode step with its weights on 4 KiB pages and on transparent huge pages, side by side
(hf_moe.huge_pages).

    python benchmarks/huge_pages.py --model smollm2-moe-work/smollm2-moe-8x-top2 [--int8 all] [--steps 600]

The model is loaded twice; one copy's weights are asked onto huge pages (`back_with_huge_pages`), the other's are
left as loaded. Each copy decodes on a static cache of its own with `hf_moe.decode_one_op.DecodePlan` (what
`generate` runs for it; the first copy's plan with `huge_pages=False`, which reads every weight in place, the
second's with its layers' small weights copied onto huge pages), the two copies alternating step by step, so load
on a shared machine hits them alike.
Printed: each copy's step time (median [20th-80th percentile]) and the per-step ratio 4 KiB / huge pages (higher:
huge pages faster), and how many bytes the kernel collapsed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spread import cell  # noqa: E402  (benchmarks/spread.py)


def load(path: str, int8: str | None):
    import hf_moe

    model = hf_moe.MoEForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    if int8:
        hf_moe.quantize_experts(model, "int8", linears=int8 == "all")
    return model


class Decoder:
    """One model copy decoding one token at a time on its own static cache, rewound when it fills."""

    def __init__(self, model, prompt: torch.Tensor, cache_len: int, huge_pages: bool = True):
        from transformers import StaticCache

        from hf_moe.compat import cache_kwargs, static_cache_layers
        from hf_moe.decode_one_op import DecodePlan, one_op_reason

        reason = one_op_reason(model)
        if reason is not None:
            raise SystemExit(f"the one-op decode step does not run this model: {reason}")
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len)
        self.token = model(prompt, use_cache=True, **cache_kwargs(self.cache)).logits[:, -1:].argmax(-1)
        self.layers, self.start = static_cache_layers(self.cache), prompt.shape[1]
        self.step = DecodePlan(model, huge_pages=huge_pages)
        self.position, self.mask, self.times = self.start, torch.zeros(1, cache_len, dtype=torch.bool), []

    def __call__(self) -> None:
        if self.position >= self.mask.shape[1] - 1:  # rewind: the cache's positions are written again
            for _, _, length in self.layers:
                length.fill_(self.start)
            self.position = self.start
        self.mask.zero_()
        self.mask[:, :self.position + 1] = True
        begin = time.perf_counter()
        logits = self.step(self.token, torch.tensor([[self.position]]), self.mask, self.layers)
        self.times.append(time.perf_counter() - begin)
        self.token, self.position = logits[:, -1:].argmax(-1), self.position + 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--int8", choices=["experts", "all"], help="int8 experts (all: and the other linear layers)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--cache-len", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from hf_moe.huge_pages import back_with_huge_pages

    small, huge = load(args.model, args.int8), load(args.model, args.int8)
    start = time.perf_counter()
    collapsed = back_with_huge_pages([*huge.parameters(), *huge.buffers()])
    took = time.perf_counter() - start
    vocab = small.config.vocab_size
    prompt = torch.randint(3, min(1000, vocab), (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        decoders = [Decoder(small, prompt, args.cache_len, huge_pages=False), Decoder(huge, prompt, args.cache_len)]
        for _ in range(args.steps):
            for decoder in decoders:
                decoder()
    warm = 20
    ratios = [a / b for a, b in zip(decoders[0].times[warm:], decoders[1].times[warm:])]
    precision = {None: "bf16", "experts": "bf16, int8 experts", "all": "bf16, int8 experts and linear layers"}
    print(f"{args.model} ({precision[args.int8]}), {args.threads} threads, torch {torch.__version__}; "
          f"{collapsed / 2**20:,.0f} MiB collapsed into huge pages in {took:.1f} s; {args.steps - warm} steps each, "
          f"alternating; load average {os.getloadavg()[0]:.1f} at the end.\n")
    print("| weights on | step ms | per-step ratio 4 KiB / huge pages |")
    print("|---|---|---|")
    print(f"| 4 KiB pages | {cell([t * 1e3 for t in decoders[0].times[warm:]], 2)} | |")
    print(f"| huge pages | {cell([t * 1e3 for t in decoders[1].times[warm:]], 2)} | {cell(ratios, 3)} |")


if __name__ == "__main__":
    main()
