"""What the reliability guarantees of issue 20 cost: the offloaded path's verification, the readers' lock, and the
guarded opener's checks.

    python benchmarks/reliability.py [--size-gb 0.5] [--repeats 5] [--work DIR]

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


def row(name: str, values: list[float], unit: str, peer: float | None, scale: float = 1.0) -> str:
    scaled = [v / scale for v in values]
    median = statistics.median(scaled)
    ratio = f"{median / peer:6.2f}x" if peer else "   peer"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", help="scratch directory (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="hf_moe_reliability_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        directory = work / "moe"
        make_model(args.size_gb).save_pretrained(directory)
        for path in directory.glob("*.safetensors"):  # into the page cache
            path.read_bytes()
        print(f"torch {torch.__version__}, {os.cpu_count()} CPU(s), {args.repeats} repeats, files in the page cache")
        offload(directory, args.repeats)
        lock(args.repeats, work)
        guard(directory, args.repeats)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
