"""What checksums cost: seconds per GB of each hash, and of `from_pretrained` with and without verification.

    python benchmarks/checksums.py [--size-gb 1.0] [--repeats 5] [--work DIR]

Saves a synthetic MoE checkpoint of about --size-gb (llama layout, fp32, random weights) and measures, each
--repeats times with the files in the page cache (the second read of a load; a first read from disk adds the same
disk time to every row):

  * hash            each candidate over the checkpoint's files through `hf_moe.checkpoint.file_checksums` (header
                    and every tensor hashed separately, as verification does): xxh3_128 (the one recorded),
                    xxh3_64, blake2b, sha256, and zlib's crc32 as a floor for a non-cryptographic checksum;
  * load            `MoEForCausalLM.from_pretrained(dir, verify_checksums=False)` (sizes and headers only) and
                    `verify_checksums=True` (every byte hashed as well);
  * save            `save_pretrained`, which records the checksums (hashing its fresh files once more).

Prints the median and the spread (min-max) of each in s/GB, and its ratio to the peer in the same table
(xxh3_128 for hashes, the unverified load for loads).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm when it is imported

import torch  # noqa: E402
import xxhash  # noqa: E402

import hf_moe.checkpoint as checkpoint  # noqa: E402


class _Crc32:
    """zlib.crc32 with the hashlib interface."""

    def __init__(self, data=b""):
        self.value = zlib.crc32(data)

    def update(self, data):
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self):
        return f"{self.value:08x}"


CANDIDATES = {
    "xxh3_128": xxhash.xxh3_128,
    "xxh3_64": xxhash.xxh3_64,
    "blake2b": hashlib.blake2b,
    "sha256": hashlib.sha256,
    "crc32": _Crc32,
}


def make_model(size_gb: float):
    from transformers import LlamaConfig

    from hf_moe import MoEConfig, MoEForCausalLM

    hidden, inter, experts = 1024, 2048, 8
    per_layer = experts * 3 * hidden * inter * 4 + 4 * hidden * hidden * 4
    layers = max(1, round(size_gb * 1e9 / per_layer))
    base = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=16)
    torch.manual_seed(0)
    return MoEForCausalLM(MoEConfig.from_base(base, num_experts=experts, num_experts_per_tok=2,
                                                    decoder_layers_path="model.layers"))


def files_of(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def size_gb(directory: Path) -> float:
    return sum(p.stat().st_size for p in files_of(directory)) / 1e9


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def row(name: str, times: list[float], gb: float, peer: float | None) -> str:
    per_gb = [t / gb for t in times]
    median = statistics.median(per_gb)
    ratio = f"{median / peer:6.2f}x" if peer else "   peer"
    return f"  {name:<34} {median:8.3f}   {min(per_gb):.3f}-{max(per_gb):.3f}   {ratio}   {gb / median:6.2f} GB/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", help="scratch directory (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    from hf_moe import MoEForCausalLM

    work = Path(args.work or tempfile.mkdtemp(prefix="hf_moe_checksums_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model = make_model(args.size_gb)
        directory = work / "moe"
        save_times = timed(lambda: model.save_pretrained(directory), max(1, args.repeats // 2))
        del model
        gb = size_gb(directory)
        files = files_of(directory)
        print(f"checkpoint: {len(files)} files, {gb:.3f} GB; torch {torch.__version__}, {os.cpu_count()} CPU(s), "
              f"{args.repeats} repeats, files in the page cache")

        for path in files:  # into the page cache
            path.read_bytes()
        hashes = {}
        for name, new in CANDIDATES.items():
            checkpoint.CHECKSUM_ALGORITHMS.setdefault(name, new)
            hashes[name] = timed(lambda n=name: [checkpoint.file_checksums(p, n) for p in files], args.repeats)
        peer = statistics.median(hashes["xxh3_128"]) / gb
        print(f"\nhashing every file (header + each tensor)   s/GB median   spread        vs xxh3_128")
        for name, times in hashes.items():
            print(row(name, times, gb, None if name == "xxh3_128" else peer))

        loads = {
            "from_pretrained, verify off": lambda: MoEForCausalLM.from_pretrained(directory, verify_checksums=False),
            "from_pretrained, verify on": lambda: MoEForCausalLM.from_pretrained(directory, verify_checksums=True),
        }
        load_times = {name: [] for name in loads}
        for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits both
            for name, load in loads.items():
                load_times[name] += timed(load, 1)
        peer = statistics.median(load_times["from_pretrained, verify off"]) / gb
        print(f"\nloading                                     s/GB median   spread        vs verify off")
        for name, times in load_times.items():
            print(row(name, times, gb, None if name.endswith("off") else peer))
        print(row("save_pretrained (records checksums)", save_times, gb, peer))
        extra = statistics.median(load_times["from_pretrained, verify on"]) - statistics.median(
            load_times["from_pretrained, verify off"]
        )
        print(f"\nverification adds {extra / gb:.3f} s/GB to a load ({extra:.2f} s for this {gb:.2f} GB checkpoint).")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
