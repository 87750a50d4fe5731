"""Write a synthetic dense Llama checkpoint (random weights, sharded safetensors) for the streaming benchmark.

    python benchmarks/make_dense_checkpoint.py OUT [--size 1.5] [--dtype bfloat16]

The default shape (hidden 1536, intermediate 4096, 24 layers, vocab 32000, bf16) is 1.55 GB, two thirds of it
in MLPs, the proportion of Llama-class models. `--size` scales the number of layers to the size asked (GB).
Weights are drawn layer by layer and written shard by shard, so making a large checkpoint needs little memory.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

HIDDEN, INTERMEDIATE, VOCAB = 1536, 4096, 32000


def layer_tensors(i: int, dtype: torch.dtype, generator: torch.Generator) -> dict[str, torch.Tensor]:
    def w(rows, cols):
        return (torch.randn(rows, cols, generator=generator) * 0.02).to(dtype)

    p = f"model.layers.{i}."
    return {
        p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=dtype),
        p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=dtype),
        **{p + f"self_attn.{n}_proj.weight": w(HIDDEN, HIDDEN) for n in ("q", "k", "v", "o")},
        p + "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
        p + "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
        p + "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--size", type=float, default=1.5, help="approximate size in GB (default 1.5)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shard-gb", type=float, default=0.5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    per_layer = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE) * dtype.itemsize
    embeddings = 2 * VOCAB * HIDDEN * dtype.itemsize
    layers = max(1, round((args.size * 1e9 - embeddings) / per_layer))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers, num_attention_heads=12,
        num_key_value_heads=12, vocab_size=VOCAB, tie_word_embeddings=False, dtype=args.dtype,
    )
    config.save_pretrained(out)
    generator = torch.Generator().manual_seed(0)
    groups = [
        lambda: {"model.embed_tokens.weight": (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02).to(dtype)},
        *[(lambda i=i: layer_tensors(i, dtype, generator)) for i in range(layers)],
        lambda: {
            "model.norm.weight": torch.ones(HIDDEN, dtype=dtype),
            "lm_head.weight": (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02).to(dtype),
        },
    ]
    shard, shard_bytes, shards = {}, 0, []

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, out / name, metadata={"format": "pt"})
            shards.append((name, list(shard)))
            shard, shard_bytes = {}, 0

    for make in groups:
        tensors = make()
        shard.update(tensors)
        shard_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if shard_bytes >= args.shard_gb * 1e9:
            flush()
    flush()
    total = len(shards)
    weight_map = {}
    for n, (name, keys) in enumerate(shards, start=1):
        final = f"model-{n:05d}-of-{total:05d}.safetensors"
        os.replace(out / name, out / final)
        weight_map.update(dict.fromkeys(keys, final))
    size = sum((out / f).stat().st_size for f in set(weight_map.values()))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2)
    )
    print(f"{out}: LlamaForCausalLM, {layers} layers, {size / 1e9:.2f} GB in {total} shards ({args.dtype})")


if __name__ == "__main__":
    main()
