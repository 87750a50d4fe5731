"""Shrinking MoE models after training: held-out loss against experts kept, for every method; size and decode speed
after shrinking; dynamic skipping's share of skipped experts against loss; a native Mixtral round trip.

    python benchmarks/shrink_models.py --workdir /tmp/shrink_work      # the models (hours on 2 shared cores)
    python benchmarks/shrink.py --workdir /tmp/shrink_work             # this benchmark
    python benchmarks/shrink.py --smoke --workdir /tmp/shrink_smoke    # tiny random models: that the script runs

Models (benchmarks/shrink_models.py): `btx`, eight domain fine-tunes of SmolLM2-135M-Instruct merged into 8
experts top-2 (BTX, routers from each domain's text), and `quickstart`, the quickstart's upcycled SmolLM2 8x2
fine-tuned longer on the mix of the eight domains. Calibration: the first --calibration-tokens tokens of the
calibration split of the eight domains, interleaved; held-out: --eval-tokens tokens of each domain's held-out split
(the splits are disjoint chunks of each domain's text). Every number is measured in this run; a method's loss is
compared with the full model's on the same tokens.

Written to --out: shrink_runs.jsonl (one line per measurement; a rerun skips what is there) and shrink.md (tables).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import hf_moe

DOMAINS = ("bible", "pydocs", "pycode", "cpp", "licenses", "metadata", "awscli", "web")
METHODS = ("reconstruction", "loss", "merge", "frequency")
THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)


# ------------------------------------------------------------------------------------------------- measuring
def eval_ids(work: Path, tokenizer, tokens: int, seq: int = 256) -> dict[str, torch.Tensor]:
    """{domain: [rows, seq] held-out token ids}, `tokens` per domain."""
    out = {}
    for name in DOMAINS:
        path = work / f"{name}.heldout.txt"
        if not path.is_file():
            continue
        ids = tokenizer(path.read_text())["input_ids"][:tokens]
        rows = max(1, len(ids) // seq)
        out[name] = torch.tensor(ids[: rows * seq]).view(rows, -1)
    return out


@torch.no_grad()
def held_out_loss(model, batches: dict[str, torch.Tensor]) -> dict[str, float]:
    """{domain: mean next-token NLL (nats)} and "mean": over all tokens."""
    model.eval()
    out, total, count = {}, 0.0, 0
    for name, ids in batches.items():
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="sum").item()
        n = ids[:, 1:].numel()
        out[name], total, count = nll / n, total + nll, count + n
    out["mean"] = total / count
    return out


@torch.no_grad()
def decode_tokens_per_s(model, prompt: torch.Tensor, new_tokens: int) -> float:
    """Greedy decode speed (tokens/s after the first new token), batch 1."""
    from hf_moe.offload import GenerationTimer

    timer = GenerationTimer()
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=timer,
                   pad_token_id=0)
    return timer.decode_tokens_per_s


def weight_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def skipped_share(model, batches) -> float:
    """Share of the (token, slot) pairs the routers chose but did not compute, over the held-out tokens."""
    skipped = total = 0
    with model.base_model.router_recorder.recording() as routings:
        for ids in batches.values():
            model(input_ids=ids)
    for r in routings:
        skipped += (r.top_k_index < 0).sum().item()
        total += r.top_k_index.numel()
    return skipped / max(total, 1)


# ------------------------------------------------------------------------------------------------ the runs
class Runs:
    """shrink_runs.jsonl: one record per measurement, keyed, so that a rerun skips what is done."""

    def __init__(self, path: Path):
        self.path = path
        self.records = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                self.records[record["key"]] = record

    def get(self, key: str):
        return self.records.get(key)

    def add(self, record: dict) -> dict:
        self.records[record["key"]] = record
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
        return record


def shrink_and_measure(runs: Runs, name: str, source: Path, work: Path, batches, calib: Path, keep: int, method: str,
                       seed: int, calibration_tokens: int) -> dict:
    key = f"{name}/{method}/keep{keep}/seed{seed}"
    if runs.get(key):
        return runs.get(key)
    out = work / "shrunk" / key.replace("/", "-")
    start = time.perf_counter()
    result = hf_moe.shrink(source, out, keep, method, calib, seed=seed, calibration_tokens=calibration_tokens)
    seconds = time.perf_counter() - start
    model = hf_moe.MoEForCausalLM.from_pretrained(out, dtype=torch.float32)
    losses = held_out_loss(model, batches)
    counts = model.parameter_counts()
    errors = [c.error for c in result.layers.values() if c.error is not None]
    record = runs.add({
        "key": key, "model": name, "method": method, "keep": keep, "seed": seed, "loss": losses,
        "parameters": counts["total"], "bytes": weight_bytes(out), "shrink_s": round(seconds, 1),
        "mean_layer_error": statistics.mean(errors) if errors else None,
        "merged_groups": sum(len(c.groups) for c in result.layers.values()),
        "calibration_loss": result.search.report() if result.search else None,
    })
    del model
    shutil.rmtree(out)
    return record


def peak_rss_of_cli_shrink(runs: Runs, name: str, source: Path, work: Path, calib: Path, keep: int,
                           calibration_tokens: int) -> dict:
    """`hf-moe shrink` in a fresh process: its peak resident memory against the size of the model's weights."""
    key = f"{name}/peak_rss/keep{keep}"
    if runs.get(key):
        return runs.get(key)
    out = work / "shrunk" / f"{name}-rss"
    # VmHWM, the high-water mark of this process's own memory: ru_maxrss would not do, as Linux carries it over
    # fork and exec from the parent (this benchmark, which holds models): it read 11.5 GiB where VmHWM read 1.1.
    code = ("import sys; from hf_moe.cli import main; from hf_moe.offload import peak_rss_bytes; "
            "status = main(sys.argv[1:]); print('PEAK_RSS', peak_rss_bytes()); sys.exit(status)")
    cmd = [sys.executable, "-c", code, "shrink", str(source), str(out), "--keep", str(keep), "--data", str(calib),
           "--calibration-tokens", str(calibration_tokens)]
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=7200, env=env)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    peak = int(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("PEAK_RSS")))
    record = runs.add({"key": key, "model": name, "keep": keep, "peak_rss": peak, "model_bytes": weight_bytes(source),
                       "command": " ".join(cmd[3:])})
    shutil.rmtree(out)
    return record


def decode_speed(runs: Runs, name: str, source: Path, work: Path, calib: Path, keeps, tokenizer, repeats: int,
                 new_tokens: int, calibration_tokens: int) -> dict:
    """Decode tokens/s of the full model, of its reconstruction-shrunk versions and of the full model with dynamic
    skipping, interleaved over `repeats` rounds in this process; ratios to the full model per round."""
    key = f"{name}/decode"
    if runs.get(key):
        return runs.get(key)
    contestants = {"full": hf_moe.MoEForCausalLM.from_pretrained(source, dtype=torch.float32).eval()}
    for keep in keeps:
        out = work / "shrunk" / f"{name}-speed-{keep}"
        if not (out / "config.json").is_file():
            hf_moe.shrink(source, out, keep, "reconstruction", calib, calibration_tokens=calibration_tokens)
        contestants[f"keep {keep}"] = hf_moe.MoEForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for threshold in (0.3, 1.0):
        contestants[f"skip {threshold}"] = hf_moe.MoEForCausalLM.from_pretrained(
            source, dtype=torch.float32, router_skip_threshold=threshold).eval()
    prompt = torch.tensor([tokenizer("The King James Bible and Python's documentation")["input_ids"]])
    for model in contestants.values():  # warm up: first calls pay one-time costs
        decode_tokens_per_s(model, prompt, 4)
    speeds = {k: [] for k in contestants}
    for _ in range(repeats):
        for label, model in contestants.items():
            speeds[label].append(decode_tokens_per_s(model, prompt, new_tokens))
    ratios = {k: [s / f for s, f in zip(v, speeds["full"])] for k, v in speeds.items()}
    record = runs.add({"key": key, "model": name, "tokens_per_s": speeds, "ratio": ratios, "threads":
                       torch.get_num_threads(), "new_tokens": new_tokens})
    for keep in keeps:
        shutil.rmtree(work / "shrunk" / f"{name}-speed-{keep}", ignore_errors=True)
    return record


def skipping(runs: Runs, name: str, source: Path, batches, thresholds=THRESHOLDS) -> list[dict]:
    out = []
    for threshold in thresholds:
        key = f"{name}/skip/{threshold}"
        if not runs.get(key):
            model = hf_moe.MoEForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                          router_skip_threshold=threshold)
            runs.add({"key": key, "model": name, "threshold": threshold, "experts": model.config.num_experts,
                      "loss": held_out_loss(model, batches),
                      "skipped": skipped_share(model, batches)})
        out.append(runs.get(key))
    return out


def native_round_trip(runs: Runs, work: Path, calib: Path, tokenizer) -> dict:
    """A tiny Mixtral (transformers' own) shrunk 8 -> 8 (logits equal) and 8 -> 4 (loads in transformers)."""
    key = "native/mixtral"
    if runs.get(key):
        return runs.get(key)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("mixtral", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  num_local_experts=8, num_experts_per_tok=2)
    source = work / "native-mixtral"
    AutoModelForCausalLM.from_config(config).save_pretrained(source)
    tokenizer.save_pretrained(source)
    ids = torch.tensor([tokenizer("In the beginning God created the heaven and the earth.")["input_ids"]])
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(source).eval()(ids).logits
        record = {"key": key}
        for keep in (8, 4):
            out = work / f"native-mixtral-{keep}"
            hf_moe.shrink(source, out, keep, "reconstruction", calib, calibration_tokens=1024, progress=False)
            model = AutoModelForCausalLM.from_pretrained(out).eval()
            record[f"keep{keep}"] = {"class": type(model).__name__, "experts": model.config.num_local_experts,
                                     "max_abs_logit_diff": (model(ids).logits - reference).abs().max().item(),
                                     "bytes": weight_bytes(out)}
        record["bytes_full"] = weight_bytes(source)
    return runs.add(record)


# ---------------------------------------------------------------------------------------------------- tables
def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} [{min(values):.4f}-{max(values):.4f}]"


def verdict(runs: Runs, name: str, base: float, keeps: list[int], seeds: list[int]) -> str:
    """The goals of shrinking (docs/shrinking.md), read off the runs: reconstruction (and the search by loss) below
    frequency and below every random seed at each size measured; the best method's loss at half the experts against
    the full model's (goal: within 2%)."""
    def loss(method, keep, seed=0):
        record = runs.get(f"{name}/{method}/keep{keep}/seed{seed}")
        return record["loss"]["mean"] if record else None

    sentences = []
    for method in ("reconstruction", "loss"):
        beats, misses = [], []
        for keep in keeps:
            mine = loss(method, keep)
            others = [loss("frequency", keep), *(loss("random", keep, s) for s in seeds)]
            if mine is None or None in others:
                continue
            (beats if mine < min(others) else misses).append(keep)
        if beats or misses:
            label = "Reconstruction" if method == "reconstruction" else "The search by loss"
            sentences.append(f"{label} below frequency and every random seed at {beats or 'none of the'} experts kept"
                             + (f"; not at {misses}." if misses and beats else "."))
    text = " ".join(sentences)
    full = runs.get(f"{name}/skip/0.0")
    half = full["experts"] // 2
    at_half = {m: loss(m, half) for m in ("reconstruction", "loss", "merge")} if half in keeps else {}
    at_half = {m: v for m, v in at_half.items() if v is not None}
    if at_half:
        method, value = min(at_half.items(), key=lambda kv: kv[1])
        change = 100 * (value / base - 1)
        text += (f" At {half} experts (half), {method}: {change:+.2f}% held-out loss against the full model: "
                 f"{'within' if change <= 2 else 'not within'} the 2% goal.")
    return text


def tables(runs: Runs, names: list[str], keeps: list[int], seeds: list[int]) -> str:
    lines = []
    for name in names:
        full = runs.get(f"{name}/skip/0.0")
        if full is None:
            continue
        base = full["loss"]["mean"]
        lines += [f"### {name}: held-out loss (nats/token) against experts kept, full model {base:.4f}", "",
                  "| experts kept | " + " | ".join(METHODS) + f" | random ({len(seeds)} seeds: mean [min-max]) | "
                  "parameters | weights |", "|---" * (len(METHODS) + 4) + "|"]
        for keep in keeps:
            cells, record = [], None
            for method in METHODS:
                record = runs.get(f"{name}/{method}/keep{keep}/seed0")
                cells.append("-" if record is None else
                             f"{record['loss']['mean']:.4f} ({100 * (record['loss']['mean'] / base - 1):+.1f}%)")
            rnd = [runs.get(f"{name}/random/keep{keep}/seed{s}") for s in seeds]
            rnd = [r["loss"]["mean"] for r in rnd if r]
            record = record or runs.get(f"{name}/random/keep{keep}/seed0")
            size = (f"{record['parameters'] / 1e6:.0f}M | {record['bytes'] / 2**20:.0f} MiB" if record else "- | -")
            lines.append(f"| {keep} | " + " | ".join(cells) + f" | {spread(rnd) if rnd else '-'} | {size} |")
        lines += ["", verdict(runs, name, base, keeps, seeds), ""]
        keep = keeps[len(keeps) // 2]
        measured = {m: runs.get(f"{name}/{m}/keep{keep}/seed0") for m in METHODS}
        measured = {m: r for m, r in measured.items() if r}  # the methods run at that size
        per_domain = list(measured.values())
        if per_domain:
            lines += [f"Per domain at {keep} experts (nats/token):", "",
                      "| domain | full | " + " | ".join(measured) + " |", "|---" * (len(measured) + 2) + "|"]
            for d in [d for d in DOMAINS if d in full["loss"]]:
                lines.append(f"| {d} | {full['loss'][d]:.4f} | " + " | ".join(f"{r['loss'][d]:.4f}" for r in per_domain)
                             + " |")
            lines.append("")
        lines += [f"Dynamic skipping on {name} (full model; a chosen expert is skipped when its weight < threshold x "
                  "the token's top weight, the rest renormalised):", "",
                  "| threshold | experts skipped (share of chosen) | held-out loss |", "|---|---|---|"]
        for r in sorted((r for k, r in runs.records.items() if k.startswith(f"{name}/skip/")),
                        key=lambda r: r["threshold"]):
            lines.append(f"| {r['threshold']} | {100 * r['skipped']:.1f}% | {r['loss']['mean']:.4f} "
                         f"({100 * (r['loss']['mean'] / base - 1):+.1f}%) |")
        lines.append("")
        speed = runs.get(f"{name}/decode")
        if speed:
            lines += [f"Decode speed on {name} ({speed['new_tokens']} new tokens, batch 1, {speed['threads']} threads; "
                      "median [min-max] of the per-round ratios to the full model):", "",
                      "| model | tokens/s (median) | ratio to full |", "|---|---|---|"]
            for label, values in speed["tokens_per_s"].items():
                ratios = speed["ratio"][label]
                lines.append(f"| {label} | {statistics.median(values):.1f} | {statistics.median(ratios):.2f} "
                             f"[{min(ratios):.2f}-{max(ratios):.2f}] |")
            lines.append("")
        rss = runs.get(f"{name}/peak_rss/{'keep' + str(keeps[len(keeps) // 2])}")
        if rss:
            lines += [f"Peak memory of `hf-moe {rss['command']}`: {rss['peak_rss'] / 2**30:.2f} GiB; the model's "
                      f"weights: {rss['model_bytes'] / 2**30:.2f} GiB.", ""]
    native = runs.get("native/mixtral")
    if native:
        lines += ["### Native Mixtral round trip (transformers' own MixtralForCausalLM, 8 experts, random weights)", "",
                  "| kept | loads as | experts | max abs logit diff to the source | weights |", "|---|---|---|---|---|"]
        for keep in (8, 4):
            r = native[f"keep{keep}"]
            lines.append(f"| {keep} | {r['class']} | {r['experts']} | {r['max_abs_logit_diff']:.2e} | "
                         f"{r['bytes'] / 2**20:.1f} MiB (of {native['bytes_full'] / 2**20:.1f}) |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- smoke
def smoke_models(work: Path) -> tuple[dict[str, Path], object]:
    """Tiny stand-ins: a random Llama upcycled to 8 experts with noise, a character tokenizer, text files."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import CORPUS, tiny_dense, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    for name in DOMAINS[:2]:
        (work / f"{name}.heldout.txt").write_text(CORPUS * 2)
    (work / "calib-mix.txt").write_text(CORPUS * 4)
    path = work / "tiny-8x2"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        model = hf_moe.convert_to_moe(tiny_dense("llama"), num_experts=8, top_k=2, noise=0.3)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return {"tiny": path}, tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="/tmp/shrink_work")
    p.add_argument("--models", default="btx,quickstart")
    p.add_argument("--keeps", default="6,4,2")
    p.add_argument("--seeds", default="0,1,2", help="seeds of random pruning")
    p.add_argument("--calibration-tokens", type=int, default=2048)
    p.add_argument("--eval-tokens", type=int, default=512, help="held-out tokens per domain")
    p.add_argument("--repeats", type=int, default=5, help="rounds of the decode-speed comparison")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--methods", default=",".join(METHODS), help="methods besides random (a subset, to run in parts)")
    p.add_argument("--thresholds", default=",".join(map(str, THRESHOLDS)),
                   help="dynamic-skipping thresholds measured (0.0, the full model, is always measured)")
    p.add_argument("--no-speed", action="store_true", help="skip the peak-memory and decode-speed measurements")
    p.add_argument("--tables-only", action="store_true", help="measure nothing: the tables of what --out holds")
    p.add_argument("--out", help="where shrink_runs.jsonl and shrink.md go (default: the workdir)")
    p.add_argument("--smoke", action="store_true", help="tiny random models, a few seconds: that the script runs")
    p.add_argument("--threads", type=int, default=1, help="torch threads (one is steadier on a shared machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or work)
    out.mkdir(parents=True, exist_ok=True)
    runs = Runs(out / "shrink_runs.jsonl")
    keeps = [int(k) for k in args.keeps.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    calib = work / "calib-mix.txt"
    if args.smoke:
        models, tokenizer = smoke_models(work)
        args.eval_tokens, args.calibration_tokens, args.repeats, args.new_tokens = 256, 512, 1, 4
    else:
        models = {"btx": work / "btx-8x2", "quickstart": work / "quickstart-8x2-ft"}
        models = {k: v for k, v in models.items() if k in args.models.split(",")}
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(next(iter(models.values())))
    torch.manual_seed(0)
    start = time.perf_counter()
    for name, source in {} if args.tables_only else models.items():
        batches = eval_ids(work, tokenizer, args.eval_tokens)
        skipping(runs, name, source, batches, sorted({0.0, *(float(t) for t in args.thresholds.split(","))}))
        for keep in keeps:
            for method in [m for m in METHODS if m in args.methods.split(",")]:
                shrink_and_measure(runs, name, source, work, batches, calib, keep, method, 0, args.calibration_tokens)
            for seed in seeds:
                shrink_and_measure(runs, name, source, work, batches, calib, keep, "random", seed,
                                   args.calibration_tokens)
        if args.no_speed:
            continue
        peak_rss_of_cli_shrink(runs, name, source, work, calib, keeps[len(keeps) // 2], args.calibration_tokens)
        decode_speed(runs, name, source, work, calib, keeps, tokenizer, args.repeats, args.new_tokens,
                     args.calibration_tokens)
    if not args.tables_only:
        native_round_trip(runs, work, calib, tokenizer)
    text = tables(runs, list(models), keeps, seeds)
    seconds = math.ceil(time.perf_counter() - start)
    text += (f"\n{torch.__version__=}, {torch.get_num_threads()} threads; this run {seconds}s (measurements already in "
             f"{runs.path.name} were not repeated).\n")
    (out / "shrink.md").write_text(text)
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
