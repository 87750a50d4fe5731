"""How far apart are an hf_moe model and its native export, and why: the same function summed in other orders.

    python benchmarks/export_bound.py MOE_DIR NATIVE_DIR [--dense DENSE_DIR] [--dtype float32]

On the export's probe (2x16 random tokens, seed 1234) and on a longer one (1x128), it prints the largest |logit|
and the max |logit difference| of pairs that compute the same function in other orders:

    hf_moe vs export               what `hf-moe export` checks (hf_moe's default kernels, transformers' default
                                   experts implementation)
    hf_moe: compiled vs torch      hf_moe's C++ kernels against its pure-torch ops (another GEMM blocking and
                                   summation order), same weights
    export: eager vs grouped_mm    transformers' two experts implementations, same weights
    dense: eager vs sdpa           the dense base model (no MoE at all) with transformers' eager attention and
                                   with torch's scaled_dot_product_attention

Models are loaded one at a time, so the peak is about twice the largest model (transformers maps the files while it
stacks the experts): run it under the heavy lock for a real model. `--dense-only` runs the dense pair alone.
"""

from __future__ import annotations

import argparse
import gc

import torch
from transformers import AutoModelForCausalLM

import hf_moe
from hf_moe.ops import use_backend


def probes(vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    short = torch.randint(0, vocab, (2, 16), generator=generator.manual_seed(1234))  # the export's own probe
    long = torch.randint(0, vocab, (1, 128), generator=torch.Generator().manual_seed(5))
    return {"2x16": short, "1x128": long}


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.double()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("moe_dir")
    parser.add_argument("native_dir")
    parser.add_argument("--dense", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dense-only", action="store_true", help="only the dense pair (a small model: no lock)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(torch.get_num_threads())

    config = hf_moe.MoEConfig.from_pretrained(args.moe_dir)
    ids = probes(config.get_text_config().vocab_size)
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in ids}
    if not args.dense_only:
        compare_moe(args, dtype, ids, out)
    if args.dense:
        for implementation in ("eager", "sdpa"):
            dense = AutoModelForCausalLM.from_pretrained(args.dense, dtype=dtype, attn_implementation=implementation)
            for name, probe in ids.items():
                out[name][f"dense {implementation}"] = logits(dense.eval(), probe)
            del dense
            gc.collect()

    pairs = [
        ("hf_moe vs export", "hf_moe", "export default"),
        ("hf_moe: compiled vs torch", "hf_moe compiled", "hf_moe torch"),
        ("export: eager vs grouped_mm", "export eager", "export grouped_mm"),
        ("dense: eager vs sdpa", "dense eager", "dense sdpa"),
    ]
    print(f"{args.moe_dir} vs {args.native_dir}, {args.dtype}\n")
    print("| probe | pair | max abs logit | max abs diff | diff / max abs logit |")
    print("|---|---|---|---|---|")
    for name, found in out.items():
        for label, a, b in pairs:
            if a in found and b in found:
                scale = found[a].abs().max().item()
                diff = (found[a] - found[b]).abs().max().item()
                print(f"| {name} | {label} | {scale:.1f} | {diff:.2e} | {diff / scale:.1e} |")


def compare_moe(args, dtype, ids, out) -> None:
    """The hf_moe model on both backends, then the export on each experts implementation, one model at a time."""
    moe = hf_moe.MoEForCausalLM.from_pretrained(args.moe_dir, dtype=dtype).eval()
    for name, probe in ids.items():
        out[name]["hf_moe"] = logits(moe, probe)
        with use_backend("torch"):
            out[name]["hf_moe torch"] = logits(moe, probe)
        with use_backend("compiled"):
            out[name]["hf_moe compiled"] = logits(moe, probe)
    del moe
    gc.collect()
    for implementation in (None, "eager", "grouped_mm"):
        kwargs = {} if implementation is None else {"experts_implementation": implementation}
        native = AutoModelForCausalLM.from_pretrained(args.native_dir, dtype=dtype, **kwargs).eval()
        for name, probe in ids.items():
            out[name][f"export {implementation or 'default'}"] = logits(native, probe)
        del native
        gc.collect()


if __name__ == "__main__":
    main()
