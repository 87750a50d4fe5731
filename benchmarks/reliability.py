"""What the reliability guarantees (docs/checkpoints.md) cost: the offloaded path's verification, the readers' lock, the
guarded opener's checks, loading by Hub id, the conversion size check, and verify's scan for non-finite values.

    python benchmarks/reliability.py [--size-gb 0.5] [--repeats 5] [--work DIR] [--only SECTION ...]

Saves a synthetic MoE checkpoint with about --size-gb of experts (llama layout, fp32, random weights; the files in
the page cache) and measures, each --repeats times, interleaved so that a slow spell of the machine hits every row:

  * offload   every expert read once through `hf_moe.offload.store.DiskExperts` (its first reads: each tensor
              hashed against the checksum recorded at save time, `verify_checksums=True`) and then again (later
              reads: one `fstat` per read, to notice a file overwritten in place); the peer is the same first reads
              with `verify_checksums=False`, and a row without the `fstat` shows what that costs;
  * lock      `from_pretrained` of a tiny checkpoint with the readers' lock (as shipped) and with
              `hf_moe.checkpoint.reading` replaced by a null context; and the lock alone (`reading(dir)` entered
              and left) against a null context, in microseconds;
  * checks    `validate_checkpoint(dir, verify_checksums=False)` (every check before load but the data hashes) with
              and without the safetensors reader's own parse of each header; and the bounded JSON parser of the
              guard (`parse_json`: UTF-8, value count, depth, duplicate keys) against plain `json.loads` on the index.

  * hub       `from_pretrained("org/name")` of a tiny checkpoint in a Hugging Face cache (offline: the id resolved to
              its snapshot, then every check) against `from_pretrained(snapshot path)` (the same checks, no resolution);
              and the resolution alone (`resolve_checkpoint`), in milliseconds;
  * size      `convert_checkpoint` (streaming) of a small dense model, with the size check (estimate, free space and
              inodes) and with `HF_MOE_SKIP_SIZE_CHECK=1`; and the check alone, in microseconds;
  * finite    `verify_checkpoint` of the --size-gb checkpoint, which hashes every byte and now counts each floating
              tensor's NaN and infinite values in the same pass, against the same hashing without the count.

Prints the median and the spread (min-max) of each, and its ratio to the peer of its table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm when it is imported

import torch  # noqa: E402

import hf_moe.checkpoint as checkpoint  # noqa: E402
import hf_moe.checkpoint.checks as checks  # noqa: E402
import hf_moe.modeling as modeling  # noqa: E402
from hf_moe import MoEConfig, MoEForCausalLM  # noqa: E402
from hf_moe.checkpoint.guard import parse_json  # noqa: E402
from hf_moe.offload.store import DiskExperts, ExpertLayout  # noqa: E402


def make_model(size_gb: float, hidden: int = 1024, inter: int = 2048, experts: int = 8):
    from transformers import LlamaConfig

    per_layer = experts * 3 * hidden * inter * 4
    layers = max(1, round(size_gb * 1e9 / per_layer))
    base = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64))
    torch.manual_seed(0)
    return MoEForCausalLM(MoEConfig.from_base(base, num_experts=experts, num_experts_per_tok=2,
                                                    decoder_layers_path="model.layers"))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def row(name: str, values: list[float], unit: str, peer: float | None | bool, scale: float = 1.0) -> str:
    scaled = [v / scale for v in values]
    median = statistics.median(scaled)
    ratio = "      -" if peer is False else f"{median / peer:6.2f}x" if peer else "   peer"  # (False: no peer)
    return f"  {name:<46} {median:10.4f} {unit:<5} {min(scaled):.4f}-{max(scaled):.4f}   {ratio}"


def read_all(store: DiskExperts, layout: ExpertLayout) -> None:
    dst = {name: torch.empty(shape, dtype=store.dtype()) for name, shape in layout.shapes.items()}
    for layer in range(layout.num_layers):
        for expert in range(layout.num_experts):
            store.read_into(layer, expert, dst)


def offload(directory: Path, repeats: int) -> None:
    config = checkpoint.checkpoint_config(directory)
    layout = ExpertLayout.from_config(config)
    gb = layout.num_layers * layout.num_experts * layout.expert_bytes(torch.float32) / 1e9
    rows = {"first reads, verification on": [], "first reads, verification off": [],
            "later reads (fstat check)": [], "later reads, no fstat check": []}
    for _ in range(repeats):
        on = DiskExperts(directory, layout, verify_checksums=True)
        rows["first reads, verification on"].append(timed(lambda: read_all(on, layout)))
        off = DiskExperts(directory, layout, verify_checksums=False)
        rows["first reads, verification off"].append(timed(lambda: read_all(off, layout)))
        rows["later reads (fstat check)"].append(timed(lambda: read_all(on, layout)))
        on._check_unchanged = lambda filename: None
        rows["later reads, no fstat check"].append(timed(lambda: read_all(on, layout)))
        on.close()
        off.close()
    peer = statistics.median(rows["first reads, verification off"]) / gb
    print(f"\noffloaded experts, {gb:.3f} GB of experts     s/GB median        spread        vs peer")
    for name, values in rows.items():
        print(row(name, values, "s/GB", None if name.endswith("verification off") else peer, gb))
    extra = (statistics.median(rows["first reads, verification on"])
             - statistics.median(rows["first reads, verification off"])) / gb
    print(f"verification adds {extra:.3f} s per GB to the first read of each expert (once per tensor).")


def lock(repeats: int, work: Path) -> None:
    tiny = make_model(0.0, hidden=64, inter=96, experts=4)
    directory = work / "tiny"
    tiny.save_pretrained(directory)
    loads = {"from_pretrained, readers' lock": [], "from_pretrained, no lock": []}
    shipped = modeling.checkpoint_reading
    for _ in range(repeats * 4):
        modeling.checkpoint_reading = shipped
        loads["from_pretrained, readers' lock"].append(timed(lambda: MoEForCausalLM.from_pretrained(directory)))
        modeling.checkpoint_reading = lambda d: contextlib.nullcontext()
        loads["from_pretrained, no lock"].append(timed(lambda: MoEForCausalLM.from_pretrained(directory)))
    modeling.checkpoint_reading = shipped
    alone = {"reading(dir) entered and left": [], "a null context": []}
    n = 1000
    for _ in range(repeats):
        alone["reading(dir) entered and left"].append(timed(lambda: [_enter(checkpoint.reading(directory))
                                                                     for _ in range(n)]))
        alone["a null context"].append(timed(lambda: [_enter(contextlib.nullcontext()) for _ in range(n)]))
    peer = statistics.median(loads["from_pretrained, no lock"])
    print(f"\nreaders' lock, a tiny checkpoint                  s median          spread        vs peer")
    for name, values in loads.items():
        print(row(name, values, "s", None if name.endswith("no lock") else peer))
    peer = statistics.median(alone["a null context"]) / n * 1e6
    for name, values in alone.items():
        print(row(name, [v / n * 1e6 for v in values], "us", None if name == "a null context" else peer))


def _enter(context) -> None:
    with context:
        pass


def guard(directory: Path, repeats: int) -> None:
    rows = {"validate_checkpoint (no data hashes)": [], "the same, without safetensors' own parse": []}
    shipped = checks._safetensors_reads
    for _ in range(repeats):
        checks._safetensors_reads = shipped
        rows["validate_checkpoint (no data hashes)"].append(
            timed(lambda: checkpoint.validate_checkpoint(directory, verify_checksums=False)))
        checks._safetensors_reads = lambda d, f: None
        rows["the same, without safetensors' own parse"].append(
            timed(lambda: checkpoint.validate_checkpoint(directory, verify_checksums=False)))
    checks._safetensors_reads = shipped
    raw = (directory / checkpoint.INDEX_NAME).read_bytes()
    parses = {"parse_json (bounded), the index": [], "json.loads, the index": []}
    for _ in range(repeats * 4):
        parses["parse_json (bounded), the index"].append(timed(lambda: parse_json(raw, "index")))
        parses["json.loads, the index"].append(timed(lambda: json.loads(raw)))
    files = len(list(directory.glob("*.safetensors")))
    peer = statistics.median(rows["the same, without safetensors' own parse"]) * 1e3
    print(f"\nchecks before load, {files} files                  ms median          spread        vs peer")
    for name, values in rows.items():
        print(row(name, [v * 1e3 for v in values], "ms", None if "without" in name else peer))
    peer = statistics.median(parses["json.loads, the index"]) * 1e3
    print(f"  ({len(raw) / 1e3:.0f} KB index)")
    for name, values in parses.items():
        print(row(name, [v * 1e3 for v in values], "ms", None if name.startswith("json.loads") else peer))


def hub(repeats: int, work: Path) -> None:
    import hashlib

    import huggingface_hub.constants as constants

    from hf_moe.checkpoint import resolve_checkpoint

    tiny = work / "tiny"  # (saved by `lock`)
    cache = work / "hub"
    root = cache / "models--org--tiny"
    snapshot = root / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    for path in tiny.iterdir():
        data = path.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0" * 40)
    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = str(cache), True
    loads = {"from_pretrained('org/tiny'), by Hub id": [], "from_pretrained(snapshot path)": []}
    for _ in range(repeats * 4):
        loads["from_pretrained('org/tiny'), by Hub id"].append(
            timed(lambda: MoEForCausalLM.from_pretrained("org/tiny")))
        loads["from_pretrained(snapshot path)"].append(timed(lambda: MoEForCausalLM.from_pretrained(snapshot)))
    n = 100
    alone = [timed(lambda: [resolve_checkpoint("org/tiny") for _ in range(n)]) / n * 1e3 for _ in range(repeats)]
    peer = statistics.median(loads["from_pretrained(snapshot path)"])
    print("\nloading by Hub id, a tiny checkpoint (offline)      s median          spread        vs peer")
    for name, values in loads.items():
        print(row(name, values, "s", None if name.endswith("path)") else peer))
    print(row("resolve_checkpoint('org/tiny') alone", alone, "ms", False))


def size_check(repeats: int, work: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_moe import convert_checkpoint
    from hf_moe.dense_mlp import extract_mlp, find_decoder_layers, find_mlp
    from hf_moe.convert.api import _expert_sizes
    from hf_moe.convert.estimate import check_disk, estimate_conversion

    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=4))
    source = work / "dense"
    dense.save_pretrained(source)
    convert = {"convert_checkpoint (8 experts), size check": [], "the same, HF_MOE_SKIP_SIZE_CHECK=1": []}
    for _ in range(repeats):
        for name in convert:
            os.environ.pop("HF_MOE_SKIP_SIZE_CHECK", None)
            if "SKIP" in name:
                os.environ["HF_MOE_SKIP_SIZE_CHECK"] = "1"
            out = work / "converted"
            convert[name].append(timed(lambda: convert_checkpoint(source, out, 8, 2, progress=False)))
            shutil.rmtree(out)
    os.environ.pop("HF_MOE_SKIP_SIZE_CHECK", None)
    _, layers = find_decoder_layers(dense)
    mlp = extract_mlp(layers[0], find_mlp(layers[0]), dense.config)
    n = 1000
    sizes = _expert_sizes("upcycle", mlp, 8, 0)
    alone = [timed(lambda: [check_disk(work / "out", estimate_conversion(10**8, mlp, sizes, 8, 4, 0, 4, 5 << 30))
                             for _ in range(n)]) / n * 1e6 for _ in range(repeats)]
    peer = statistics.median(convert["the same, HF_MOE_SKIP_SIZE_CHECK=1"])
    print(f"\nconversion size check, {sum(p.numel() for p in dense.parameters()) / 1e6:.1f}M dense parameters    "
          "s median          spread        vs peer")
    for name, values in convert.items():
        print(row(name, values, "s", None if "SKIP" in name else peer))
    print(row("estimate + free space + inodes, alone", alone, "us", False))


def finite(directory: Path, repeats: int) -> None:
    import hf_moe.checkpoint.verify as verify

    gb = sum(p.stat().st_size for p in directory.glob("*.safetensors")) / 1e9
    rows = {"verify_checkpoint (hashes + non-finite count)": [], "verify_checkpoint, hashes only": []}
    shipped = verify.checksum_problems
    for _ in range(repeats):
        verify.checksum_problems = shipped
        rows["verify_checkpoint (hashes + non-finite count)"].append(
            timed(lambda: checkpoint.verify_checkpoint(directory)))
        verify.checksum_problems = lambda *args, finite=False: shipped(*args)
        rows["verify_checkpoint, hashes only"].append(timed(lambda: checkpoint.verify_checkpoint(directory)))
    verify.checksum_problems = shipped
    peer = statistics.median(rows["verify_checkpoint, hashes only"]) / gb
    print(f"\nhf-moe verify, {gb:.3f} GB                            s/GB median        spread        vs peer")
    for name, values in rows.items():
        print(row(name, values, "s/GB", None if name.endswith("only") else peer, gb))


SECTIONS = ["offload", "lock", "checks", "hub", "size", "finite"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", help="scratch directory (default: a temporary one, removed at the end)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS, help="the tables to measure")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="hf_moe_reliability_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        directory = work / "moe"
        make_model(args.size_gb).save_pretrained(directory)
        for path in directory.glob("*.safetensors"):  # into the page cache
            path.read_bytes()
        print(f"torch {torch.__version__}, {os.cpu_count()} CPU(s), {args.repeats} repeats, files in the page cache")
        if "offload" in args.only:
            offload(directory, args.repeats)
        if "lock" in args.only or "hub" in args.only:
            lock(args.repeats, work)  # (saves the tiny checkpoint `hub` loads)
        if "checks" in args.only:
            guard(directory, args.repeats)
        if "hub" in args.only:
            hub(args.repeats, work)
        if "size" in args.only:
            size_check(args.repeats, work)
        if "finite" in args.only:
            finite(directory, args.repeats)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
