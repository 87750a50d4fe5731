"""Offloaded inference on this machine: hf_moe's expert cache against the fully loaded model and accelerate's disk
offload, at the same peak RSS.

    python benchmarks/offload.py --model smollm2-moe-work/smollm2-moe-8x-top2 --workdir offload-work

For each model (an hf_moe checkpoint such as the quickstart's 8x top-2 SmolLM2, and unless --no-synthetic a synthetic
model with 32 experts built here), every configuration runs in a process of its own (benchmarks/serve_worker.py),
so that peak RSS (VmHWM) is that configuration's; all of a model's processes stay alive and every repeat runs each
configuration in turn (interleaved: load on a shared machine hits them alike):

    full            MoEForCausalLM.from_pretrained(dir)
    hf_moe          from_pretrained(dir, offload_experts="disk", max_expert_memory=B): B = --budget-fraction (25%)
                    of the expert bytes, no prefetch (the CPU default)
    hf_moe pf       the same with offload_prefetch=True
    accelerate      from_pretrained(dir, device_map="auto", max_memory={"cpu": X}, offload_folder=tmp): whole modules
                    on disk, loaded at every forward; X tuned (--accelerate-tries) so that its peak RSS comes down to
                    hf_moe's, or as close as it gets
    hf_moe =RSS     hf_moe offload with the budget that gives accelerate's peak RSS: the comparison at equal memory
                    when accelerate cannot come down to hf_moe's
    hf_moe bf16     (--bf16) the checkpoint saved once in bf16 (half the bytes per expert read), offloaded with the
                    byte budget B (twice the experts resident); accelerate on that bf16 checkpoint; and hf_moe bf16
                    with the budget that gives accelerate bf16's peak RSS
    runtime         a process that only imports torch, transformers and hf_moe: the RSS every configuration pays

Each configuration warms up once, then generates --new-tokens greedily after a --prompt-tokens prompt --repeats
times: prefill tok/s (prompt tokens / time to the first token) and decode tok/s (the steps after the first token /
their time), median and min-max, and the per-repeat ratio of each to accelerate's. The hf_moe run records the routing
trace, replayed through each cache policy (hf_moe/offload/simulate.py) for the policy table.

Heavy: the fully loaded SmolLM2 MoE peaks near 5.5 GB while loading, and all of a model's configurations are alive at
once (about 12 GB for SmolLM2). Run it under the shared lock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workers import Worker  # noqa: E402  (benchmarks/workers.py)


def worker(args, model: str, name: str, *extra: str, precision: str = "fp32") -> Worker:
    cmd = [sys.executable, os.path.join(HERE, "serve_worker.py"), "--engine", "hf_moe", "--model", model,
           "--precision", precision, "--threads", str(args.threads), *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error")
    print(f"  starting {name} ...", file=sys.stderr, flush=True)
    w = Worker(cmd, name, env=env)
    return w


def runtime_rss() -> int:
    code = ("import torch, transformers, hf_moe\nfor l in open('/proc/self/status'):\n"
            "    l.startswith('VmHWM') and print(int(l.split()[1]) * 1024)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def build_synthetic(directory: str, experts: int, layers: int, hidden: int, intermediate: int) -> None:
    """A llama-shaped MoE with `experts` experts (top-2) per layer: upcycled from a random dense model, with noise
    so that the experts differ, and a random router."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_moe import convert_to_moe

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    dense = AutoModelForCausalLM.from_config(config).eval()
    convert_to_moe(dense, num_experts=experts, top_k=2, noise=0.5, verify=False).save_pretrained(directory)


def bf16_copy(model: str, workdir: str) -> str:
    """The checkpoint saved once in bf16 (per expert, as any hf_moe checkpoint)."""
    directory = os.path.join(workdir, os.path.basename(os.path.normpath(model)) + "-bf16")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        import torch

        from hf_moe import MoEForCausalLM

        MoEForCausalLM.from_pretrained(model, dtype=torch.bfloat16).save_pretrained(directory)
    return directory


def checkpoint_bytes(directory: str) -> tuple[int, int]:
    """(expert bytes, non-expert bytes) of a saved hf_moe checkpoint, from its safetensors headers."""
    from hf_moe.inspect import summarize_checkpoint

    summary = summarize_checkpoint(directory)
    expert = sum(s.num_bytes for s in summary.shards if s.experts)
    other = sum(s.num_bytes for s in summary.shards if not s.experts)
    return expert, other


def measure(w: Worker, ids: list[int], args) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy generate."""
    times = w.call("generate", prompt=ids, new_tokens=args.new_tokens, stop_at_eos=False, mode="eager")["times"]
    return len(ids) / times[1], (len(times) - 2) / (times[-1] - times[1])


def offload_args(budget: int, prefetch: bool) -> list[str]:
    return ["--offload-experts", "disk", "--max-expert-memory", str(budget), "--offload-prefetch",
            "on" if prefetch else "off"]


def accelerate(args, model: str, name: str, goal: int, runtime: int, layer_bytes: int, floor: int, ids):
    """accelerate's offload with max_memory tuned so that its peak RSS (after a warm-up generate) meets `goal`."""
    memory, best = max(goal - runtime - layer_bytes, floor), None
    for _ in range(args.accelerate_tries):
        folder = tempfile.mkdtemp(prefix="offload-acc-", dir=args.workdir)
        w = worker(args, model, name, "--accelerate-max-memory", str(int(memory)), "--offload-folder", folder)
        measure(w, ids, args)
        rss = w.call("rss")["peak_rss"]
        if best is None or abs(rss - goal) < abs(best[1] - goal):
            if best is not None:
                best[0].close()
            best = (w, rss, int(memory))
        else:
            w.close()
        if abs(rss - goal) <= 0.05 * goal:
            break
        memory = max(memory + (goal - rss), 0)
    return best


def bench_model(title: str, model: str, args, runtime: int) -> list[str]:
    import random

    from hf_moe import MoEConfig

    expert_bytes, other_bytes = checkpoint_bytes(model)
    budget = int(expert_bytes * args.budget_fraction)
    config = MoEConfig.from_pretrained(model)
    layer_bytes = expert_bytes // len(config.moe_layers)
    ids = [random.Random(0).randrange(3, config.vocab_size) for _ in range(args.prompt_tokens)]
    print(f"{title}: experts {mib(expert_bytes)} MiB, non-expert {mib(other_bytes)} MiB, budget {mib(budget)} MiB",
          file=sys.stderr, flush=True)
    workers: dict[str, Worker] = {}
    notes: dict[str, str] = {}
    try:
        workers["full"] = worker(args, model, "full")
        workers["hf_moe"] = worker(args, model, "hf_moe", *offload_args(budget, False))
        workers["hf_moe pf"] = worker(args, model, "hf_moe pf", *offload_args(budget, True))
        measure(workers["hf_moe"], ids, args)
        goal = workers["hf_moe"].call("rss")["peak_rss"]
        w, acc_rss, acc_memory = accelerate(args, model, "accelerate", goal, runtime, layer_bytes, other_bytes // 2,
                                            ids)
        workers["accelerate"] = w
        info = w.call("info")
        notes["accelerate"] = f"max_memory cpu {mib(acc_memory)} MiB; {info.get('offloaded', '?')}"
        if acc_rss > 1.05 * goal:  # accelerate cannot come down: give hf_moe accelerate's memory instead
            equal = min(budget + acc_rss - goal, expert_bytes)
            workers["hf_moe =RSS"] = worker(args, model, "hf_moe =RSS", *offload_args(int(equal), False))
            notes["hf_moe =RSS"] = f"budget {mib(equal)} MiB"
        if args.bf16:
            half = bf16_copy(model, args.workdir)
            workers["hf_moe bf16"] = worker(args, half, "hf_moe bf16", *offload_args(budget, False), precision="bf16")
            notes["hf_moe bf16"] = f"bf16 checkpoint, budget {mib(budget)} MiB"
            folder = tempfile.mkdtemp(prefix="offload-acc-", dir=args.workdir)
            workers["accelerate bf16"] = worker(args, half, "accelerate bf16", "--accelerate-max-memory",
                                                str(acc_memory), "--offload-folder", folder, precision="bf16")
            notes["accelerate bf16"] = f"bf16 checkpoint, max_memory cpu {mib(acc_memory)} MiB"
            measure(workers["hf_moe bf16"], ids, args)
            measure(workers["accelerate bf16"], ids, args)
            gap = workers["accelerate bf16"].call("rss")["peak_rss"] - workers["hf_moe bf16"].call("rss")["peak_rss"]
            if gap > 0.05 * workers["hf_moe bf16"].call("rss")["peak_rss"]:  # the bf16 pair at equal memory too
                equal = int(min(budget + gap, expert_bytes // 2))
                workers["hf_moe bf16 =RSS"] = worker(args, half, "hf_moe bf16 =RSS", *offload_args(equal, False),
                                                     precision="bf16")
                notes["hf_moe bf16 =RSS"] = f"bf16 checkpoint, budget {mib(equal)} MiB"
        for name, w in workers.items():
            if name != "accelerate":
                measure(w, ids, args)  # warm-up
        for name in ("hf_moe", "hf_moe pf", "hf_moe =RSS", "hf_moe bf16", "hf_moe bf16 =RSS"):
            if name in workers:
                workers[name].call("cache", reset=True)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in workers}
        for repeat in range(args.repeats):
            for name, w in workers.items():
                runs[name].append(measure(w, ids, args))
            print(f"  repeat {repeat + 1}/{args.repeats} (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        rss = {name: w.call("rss")["peak_rss"] for name, w in workers.items()}
        caches = {name: workers[name].call("cache") for name in runs if name.startswith("hf_moe")}
    finally:
        for w in workers.values():
            w.close()
    return table(title, args, runs, rss, caches, notes, runtime, expert_bytes, other_bytes, budget, config)


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(title, args, runs, rss, caches, notes, runtime, expert_bytes, other_bytes, budget, config) -> list[str]:
    from hf_moe.offload.simulate import simulate

    lines = [
        f"### {title}", "",
        f"Experts {mib(expert_bytes)} MiB, non-expert weights {mib(other_bytes)} MiB; expert budget {mib(budget)} MiB "
        f"({100 * args.budget_fraction:.0f}% of the expert bytes). Prompt {args.prompt_tokens} tokens, "
        f"{args.new_tokens} new tokens, greedy, batch 1, {args.threads} threads; median (min-max) of {args.repeats} "
        f"interleaved runs. Runtime alone (python + torch + transformers + hf_moe imported): {mib(runtime)} MiB.", "",
        "| configuration | decode tok/s | / accelerate | prefill tok/s | peak RSS MiB | expert cache |",
        "|---|---|---|---|---|---|",
    ]
    acc = runs["accelerate"]
    for name, r in runs.items():
        cache = "-"
        if name in caches:
            c = caches[name]
            cache = f"{c['slots']} slots, hit rate {100 * c['hit_rate']:.1f}%"
            if c["prefetch"]:
                cache += f", prefetch accuracy {100 * c['prefetch_accuracy']:.1f}%"
        label = name + (f" ({notes[name]})" if name in notes else "")
        ratio = spread([a[1] / b[1] for a, b in zip(r, acc)])
        lines.append(f"| {label} | {spread([x[1] for x in r])} | {ratio} | {spread([x[0] for x in r])} | "
                     f"{mib(rss[name])} | {cache} |")
    if "accelerate bf16" in runs:
        lines.append("")
        for name in ("hf_moe bf16", "hf_moe bf16 =RSS"):
            if name in runs:
                ratio = spread([a[1] / b[1] for a, b in zip(runs[name], runs["accelerate bf16"])])
                lines.append(f"- {name} / accelerate bf16, decode: {ratio} at peak RSS {mib(rss[name])} vs "
                             f"{mib(rss['accelerate bf16'])} MiB.")
    trace = caches["hf_moe"]["trace"]
    slots = caches["hf_moe"]["slots"]
    lines += ["", f"Cache policies replayed on the hf_moe run's routing trace ({len(trace)} layer forwards), {slots} "
              "slots: hit rate and expert reads per layer forward.", "",
              "| policy | hit rate, no prefetch | reads/forward | hit rate, prefetch | reads/forward | prefetch accuracy |",
              "|---|---|---|---|---|---|"]
    for policy in ("lru", "lfu", "lfu_decay", "next_use", "belady"):
        plain = simulate(trace, config.num_experts, slots, config.num_experts_per_tok, policy, prefetch=False)
        ahead = simulate(trace, config.num_experts, slots, config.num_experts_per_tok, policy, prefetch=True)
        reads = lambda s: (s.demand_fetches + s.prefetches) / len(trace)  # noqa: E731
        lines.append(f"| {policy} | {100 * plain.hit_rate:.1f}% | {reads(plain):.2f} | {100 * ahead.hit_rate:.1f}% | "
                     f"{reads(ahead):.2f} | {100 * ahead.prefetch_accuracy:.1f}% |")
    return lines + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="an hf_moe checkpoint directory (e.g. the quickstart's SmolLM2 8x top-2)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "offload-work"))
    p.add_argument("--no-synthetic", action="store_true", help="skip the synthetic 32-expert model")
    p.add_argument("--synthetic-experts", type=int, default=32)
    p.add_argument("--synthetic-layers", type=int, default=8)
    p.add_argument("--budget-fraction", type=float, default=0.25)
    p.add_argument("--bf16", action="store_true", help="also a bf16 copy of the checkpoint, offloaded (and accelerate)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--accelerate-tries", type=int, default=2)
    p.add_argument("--out", help="also write the tables (markdown) here")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    models = []
    if args.model:
        models.append((os.path.basename(os.path.normpath(args.model)), args.model))
    if not args.no_synthetic:
        name = f"synthetic-{args.synthetic_experts}x-top2-{args.synthetic_layers}layers"
        directory = os.path.join(args.workdir, name)
        build_synthetic(directory, args.synthetic_experts, args.synthetic_layers, 512, 1024)
        models.append((name, directory))
    if not models:
        p.error("nothing to measure: give --model, or leave out --no-synthetic")
    runtime = runtime_rss()
    lines = ["Command: `python benchmarks/offload.py " + " ".join(sys.argv[1:]) + "`", "",
             f"Load average at the start: {os.getloadavg()[0]:.1f}.", ""]
    for title, directory in models:
        lines += bench_model(title, directory, args, runtime)
    lines.append(f"Load average at the end: {os.getloadavg()[0]:.1f}.")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
