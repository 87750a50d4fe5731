"""Offloaded inference on this machine: hf_moe's expert cache against the fully loaded model and accelerate's offload.

For each model (an hf_moe checkpoint such as the quickstart's 8x top-2 SmolLM2, and a synthetic model with 32
experts built here), with an expert budget of 25% of the expert bytes, every configuration runs in its own
process so that peak RSS (VmHWM) is that configuration's:

    full          MoEForCausalLM.from_pretrained(dir)
    hf_moe        from_pretrained(dir, offload_experts="disk", max_expert_memory=25% of the expert bytes)
    hf_moe no-pf  the same without prefetching the next layer's experts
    accelerate    from_pretrained(dir, device_map="auto", max_memory={"cpu": X}, offload_folder=tmp): whole decoder
                  layers on disk, loaded at every step; X is tuned so that its peak RSS matches hf_moe's
    runtime       a process that only imports torch, transformers and hf_moe: the RSS every configuration pays

Each configuration warms up once, then generates `--new-tokens` greedily after a `--prompt-tokens` prompt
`--repeats` times: prefill tok/s (prompt tokens / prefill time) and decode tok/s (steps after the first token /
their time), as median and min-max over the repeats. The hf_moe run also records the routing trace, which is replayed
through each cache policy (hf_moe/offload/simulate.py) for the policy table.

    python benchmarks/offload.py --model /tmp/offload-work/smollm2-moe-8x-top2 --workdir /tmp/offload-work

Heavy: the fully loaded SmolLM2 MoE peaks near 5.5 GB while loading. One configuration runs at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = (
    "The history of the city begins with a small settlement on the river, where traders from the north and the "
    "south met to exchange grain, salt, wool and news. Over the centuries the settlement grew into a market town, "
    "then into a city with walls, bridges, schools and a great library that drew scholars from far away. "
)


# ----------------------------------------------------------------------------------------------------------------
# Child: one configuration, one process
# ----------------------------------------------------------------------------------------------------------------
def child(args) -> None:
    import torch

    from hf_moe import MoEForCausalLM
    from hf_moe.offload import GenerationTimer, expert_cache, peak_rss_bytes

    result = {"config": args.child}
    if args.child == "runtime":
        result["peak_rss"] = peak_rss_bytes()
        print(json.dumps(result))
        return
    torch.manual_seed(0)
    start = time.perf_counter()
    if args.child == "full":
        model = MoEForCausalLM.from_pretrained(args.model)
    elif args.child in ("hf_moe", "hf_moe_nopf"):
        model = MoEForCausalLM.from_pretrained(
            args.model, offload_experts="disk", max_expert_memory=args.budget, offload_prefetch=args.child == "hf_moe"
        )
    elif args.child == "accelerate":
        folder = tempfile.mkdtemp(prefix="offload-acc-", dir=args.workdir)
        model = MoEForCausalLM.from_pretrained(
            args.model, device_map="auto", max_memory={"cpu": args.accelerate_memory}, offload_folder=folder
        )
        result["device_map"] = sorted(set(model.hf_device_map.values()))
        result["layers_on_disk"] = sum(v == "disk" for v in model.hf_device_map.values())
    else:
        raise SystemExit(f"unknown configuration {args.child}")
    model.eval()
    result["load_s"] = time.perf_counter() - start
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, args.prompt_tokens), generator=generator)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    cache = expert_cache(model) if args.child.startswith("hf_moe") else None
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up (extension load, page cache)
        if cache is not None:
            cache.stats.reset()
            cache.trace = []
        prefill, decode = [], []
        for _ in range(args.repeats):
            timer = GenerationTimer()
            model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, streamer=timer, **kwargs)
            prefill.append(args.prompt_tokens / timer.prefill_s)
            decode.append(timer.decode_tokens_per_s)
    result.update(prefill_tok_s=prefill, decode_tok_s=decode, peak_rss=peak_rss_bytes())
    if cache is not None:
        s = cache.stats
        result.update(
            hit_rate=s.hit_rate, prefetch_accuracy=s.prefetch_accuracy, bytes_read=s.bytes_read, wait_s=s.wait_s,
            uses=s.uses, slots=cache.num_slots, pool_bytes=cache.pool_bytes(), policy=cache.policy.name,
        )
        trace_path = os.path.join(args.workdir, f"trace-{os.path.basename(os.path.normpath(args.model))}.json")
        with open(trace_path, "w") as f:
            json.dump(cache.trace, f)
        result["trace"] = trace_path
    print(json.dumps(result))


# ----------------------------------------------------------------------------------------------------------------
# Parent: build the synthetic model, run the configurations, print the tables
# ----------------------------------------------------------------------------------------------------------------
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
    moe = convert_to_moe(dense, num_experts=experts, top_k=2, noise=0.5, verify=False)
    moe.save_pretrained(directory)


def checkpoint_bytes(directory: str) -> tuple[int, int]:
    """(expert bytes, non-expert bytes) of a saved hf_moe checkpoint, from its safetensors headers."""
    from hf_moe.inspect import summarize_checkpoint

    summary = summarize_checkpoint(directory)
    expert = sum(s.num_bytes for s in summary.shards if s.experts)
    other = sum(s.num_bytes for s in summary.shards if not s.experts)
    return expert, other


def run_child(config: str, args, model: str, **extra) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--model", model, "--workdir", args.workdir,
           "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
           "--repeats", str(args.repeats)]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    tag = "-".join([os.path.basename(os.path.normpath(model)), config, *map(str, extra.values())])
    saved = os.path.join(args.workdir, f"result-{tag}.json")
    if args.reuse and os.path.isfile(saved):  # redraw the tables from earlier runs
        with open(saved) as f:
            return json.load(f)
    print(f"  running {config} {' '.join(f'{k}={v}' for k, v in extra.items())} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(saved, "w") as f:
        json.dump(result, f)
    print(f"    peak RSS {result['peak_rss'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    return result


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def bench_model(name: str, model: str, args, runtime_rss: int) -> list[str]:
    from hf_moe.offload.simulate import simulate

    expert_bytes, other_bytes = checkpoint_bytes(model)
    budget = int(expert_bytes * args.budget_fraction)
    target = other_bytes + budget
    print(f"{name}: experts {mib(expert_bytes)} MiB, non-expert {mib(other_bytes)} MiB, budget {mib(budget)} MiB",
          file=sys.stderr, flush=True)
    results = {}
    results["hf_moe"] = run_child("hf_moe", args, model, budget=budget)
    results["hf_moe_nopf"] = run_child("hf_moe_nopf", args, model, budget=budget)
    results["full"] = run_child("full", args, model)
    # accelerate: its max_memory counts the weights it keeps; tune it until its peak RSS is hf_moe's (within 5%).
    goal = results["hf_moe"]["peak_rss"]
    import hf_moe

    config = hf_moe.MoEConfig.from_pretrained(model)
    layer_bytes = expert_bytes // len(config.moe_layers)  # one offloaded decoder layer is read at a time
    memory = max(goal - runtime_rss - layer_bytes, other_bytes // 2)
    for _ in range(args.accelerate_tries):
        acc = run_child("accelerate", args, model, accelerate_memory=int(memory))
        acc["max_memory"] = int(memory)
        if "accelerate" not in results or abs(acc["peak_rss"] - goal) < abs(results["accelerate"]["peak_rss"] - goal):
            results["accelerate"] = acc
        if abs(acc["peak_rss"] - goal) <= 0.05 * goal:
            break
        memory = max(memory + (goal - acc["peak_rss"]), 0)

    off, acc = results["hf_moe"], results["accelerate"]
    lines = [
        f"### {name}",
        "",
        f"Experts {mib(expert_bytes)} MiB, non-expert weights {mib(other_bytes)} MiB; expert budget "
        f"{mib(budget)} MiB ({100 * args.budget_fraction:.0f}% of the expert bytes, {off['slots']} expert slots). "
        f"Prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy, batch 1; median (min-max) of "
        f"{args.repeats} runs. Runtime alone (python + torch + transformers + hf_moe imported): {mib(runtime_rss)} MiB.",
        "",
        "| configuration | decode tok/s | prefill tok/s | peak RSS MiB | RSS - runtime MiB | expert cache |",
        "|---|---|---|---|---|---|",
    ]
    labels = {
        "full": "fully loaded",
        "hf_moe": f"hf_moe offload (disk, {off['policy']}, prefetch)",
        "hf_moe_nopf": "hf_moe offload (disk, no prefetch)",
        "accelerate": f"accelerate device_map disk offload (max_memory cpu {mib(acc['max_memory'])} MiB, "
                      + ("everything on disk)" if acc.get("device_map") == ["disk"] else
                         f"{acc.get('layers_on_disk', '?')} modules on disk)"),
    }
    for key in ("full", "hf_moe", "hf_moe_nopf", "accelerate"):
        r = results[key]
        cache = "-"
        if "hit_rate" in r:
            cache = f"hit rate {100 * r['hit_rate']:.1f}%"
            if r["prefetch_accuracy"]:
                cache += f", prefetch accuracy {100 * r['prefetch_accuracy']:.1f}%"
        lines.append(
            f"| {labels[key]} | {spread(r['decode_tok_s'])} | {spread(r['prefill_tok_s'])} | {mib(r['peak_rss'])} | "
            f"{mib(r['peak_rss'] - runtime_rss)} | {cache} |"
        )
    nopf = results["hf_moe_nopf"]
    speed = statistics.median(off["decode_tok_s"]) / statistics.median(acc["decode_tok_s"])
    speed_nopf = statistics.median(nopf["decode_tok_s"]) / statistics.median(acc["decode_tok_s"])
    if acc["peak_rss"] > 1.05 * off["peak_rss"]:
        lines += ["", f"- accelerate's peak RSS does not come down to hf_moe's: {mib(acc['peak_rss'])} MiB is its "
                  "lowest here (max_memory tuned down to what is shown; loading the offloaded weights sets the peak)."]
    lines += [
        "",
        f"- hf_moe / accelerate decode tok/s: **{speed:.2f}x** with prefetch, **{speed_nopf:.2f}x** without, at peak "
        f"RSS {mib(off['peak_rss'])} / {mib(nopf['peak_rss'])} vs {mib(acc['peak_rss'])} MiB.",
        f"- hf_moe peak RSS - runtime = {mib(off['peak_rss'] - runtime_rss)} MiB against non-expert bytes + budget = "
        f"{mib(target)} MiB ({100 * (off['peak_rss'] - runtime_rss) / target - 100:+.1f}%); counting the runtime, "
        f"{100 * off['peak_rss'] / target - 100:+.1f}%.",
    ]
    # Policies, replayed on the routing trace of the hf_moe run.
    with open(off["trace"]) as f:
        trace = json.load(f)
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    steps = len(trace)
    lines += [
        "",
        f"Cache policies replayed on this run's routing trace ({steps} layer forwards), {off['slots']} slots: hit rate "
        "(experts per forward found resident or already fetched ahead) and expert reads per layer forward.",
        "",
        "| policy | hit rate, no prefetch | reads/forward | hit rate, prefetch | reads/forward | prefetch accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for policy in ("lru", "lfu", "lfu_decay", "next_use", "belady"):
        plain = simulate(trace, num_experts, off["slots"], top_k, policy, prefetch=False)
        ahead = simulate(trace, num_experts, off["slots"], top_k, policy, prefetch=True)
        reads = lambda s: (s.demand_fetches + s.prefetches) / steps  # noqa: E731
        label = "belady (offline optimum)" if policy == "belady" else policy
        lines.append(
            f"| {label} | {100 * plain.hit_rate:.1f}% | {reads(plain):.2f} | {100 * ahead.hit_rate:.1f}% | "
            f"{reads(ahead):.2f} | {100 * ahead.prefetch_accuracy:.1f}% |"
        )
    return lines + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="an hf_moe checkpoint directory (e.g. the quickstart's SmolLM2 8x top-2)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "offload-work"))
    p.add_argument("--no-synthetic", action="store_true", help="skip the synthetic 32-expert model")
    p.add_argument("--synthetic-experts", type=int, default=32)
    p.add_argument("--synthetic-layers", type=int, default=8)
    p.add_argument("--budget-fraction", type=float, default=0.25)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--accelerate-tries", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    p.add_argument("--out", help="also write the tables (markdown) here")
    p.add_argument("--reuse", action="store_true", help="reuse the results of configurations already run (in --workdir)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    p.add_argument("--accelerate-memory", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    if args.child:
        child(args)
        return
    models = []
    if args.model:
        models.append((f"{os.path.basename(os.path.normpath(args.model))}", args.model))
    if not args.no_synthetic:
        name = f"synthetic-{args.synthetic_experts}x-top2-{args.synthetic_layers}layers"
        directory = os.path.join(args.workdir, name)
        build_synthetic(directory, args.synthetic_experts, args.synthetic_layers, 512, 1024)
        models.append((name, directory))
    runtime = run_child("runtime", args, models[0][1])["peak_rss"]
    lines = ["Command: `python benchmarks/offload.py " + " ".join(sys.argv[1:]) + "`", ""]
    for name, directory in models:
        lines += bench_model(name, directory, args, runtime)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
