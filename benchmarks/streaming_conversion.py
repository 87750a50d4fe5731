"""Streaming conversion of a large dense checkpoint: peak memory and throughput, against `cp` and the in-memory
path, in one run.

    python benchmarks/streaming_conversion.py [--src DIR] [--size 1.5] [--num-experts 8] [--work DIR]

Makes a synthetic dense checkpoint with `make_dense_checkpoint.py` (unless --src is given), then runs under
`/usr/bin/time -v`:
  * stream     `hf-moe convert SRC OUT --num-experts E --top-k 2` (tensor by tensor, the default)
  * cp         `cp -r OUT COPY`: copying the bytes the conversion writes, the I/O floor
  * in-memory  the same conversion with `--in-memory` (loads the model, converts, saves); skip with --no-in-memory
Printed (best of --repeats runs): wall time and its ratio to cp's, the conversion's own time as the CLI reports it
(without Python start-up), output throughput, peak RSS and its ratio to the size of the dense checkpoint.
"""

from __future__ import annotations

import argparse
import re
import statistics
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed(cmd: list[str]) -> tuple[float, int, float | None]:
    """(wall seconds, peak RSS bytes, seconds `hf-moe convert` reports for the conversion itself, after Python
    and its imports start) of `cmd` under /usr/bin/time -v, started with no dirty pages pending (so an earlier
    command's writeback does not slow it down)."""
    subprocess.run(["sync"], check=True)
    result = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", result.stderr)
    hours, minutes, seconds = (float(g) if g else 0.0 for g in wall.groups())
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr).group(1)) * 1024
    inner = re.search(r" in ([\d.]+)s \(", result.stdout)
    return hours * 3600 + minutes * 60 + seconds, rss, float(inner.group(1)) if inner else None


def best(runs: list[tuple]) -> tuple:
    """The fastest of repeated runs (the one least disturbed by the shared machine)."""
    return min(runs, key=lambda run: run[0])


def size_of(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", help="a dense safetensors checkpoint (default: make a synthetic one)")
    parser.add_argument("--size", type=float, default=1.5, help="GB of the synthetic checkpoint")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--work", help="scratch directory (default: a temporary one, removed at the end)")
    parser.add_argument("--no-in-memory", action="store_true", help="skip the in-memory conversion")
    parser.add_argument("--repeats", type=int, default=2, help="runs of stream and cp, interleaved (best kept)")
    args = parser.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="hf_moe_stream_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        src = Path(args.src) if args.src else work / "dense"
        if not args.src:
            subprocess.run([sys.executable, str(HERE / "make_dense_checkpoint.py"), str(src), "--size", str(args.size)],
                           check=True)
        dense_bytes = size_of(src)
        convert = [sys.executable, "-m", "hf_moe.cli", "convert", str(src)]
        counts = ["--num-experts", str(args.num_experts), "--top-k", str(args.top_k)]

        runs: dict[str, list] = {"stream": [], "cp": [], "in-memory": []}
        for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits both
            shutil.rmtree(work / "stream", ignore_errors=True)
            runs["stream"].append(timed([*convert, str(work / "stream"), *counts]))
            runs["cp"].append(timed(["cp", "-r", str(work / "stream"), str(work / "copy")]))
            shutil.rmtree(work / "copy")
        out_bytes = size_of(work / "stream")
        if not args.no_in_memory:
            runs["in-memory"].append(timed([*convert, str(work / "memory"), *counts, "--in-memory"]))
            shutil.rmtree(work / "memory")

        cp_time = best(runs["cp"])[0]
        print(f"\ndense checkpoint {dense_bytes / 1e9:.2f} GB -> MoE checkpoint {out_bytes / 1e9:.2f} GB "
              f"({args.num_experts} experts, top-{args.top_k}); best of {args.repeats} runs\n")
        print(f"{'':<10} {'wall s':>7} {'time/cp':>8} {'convert s':>10} {'convert/cp':>11} {'GB/s out':>9} "
              f"{'peak RSS GB':>12} {'RSS/dense':>10}")
        for name, results in runs.items():
            if not results:
                continue
            wall, rss, inner = best(results)
            inner_cols = f"{inner:>10.1f} {inner / cp_time:>11.2f}" if inner is not None else f"{'':>10} {'':>11}"
            print(f"{name:<10} {wall:>7.1f} {wall / cp_time:>8.2f} {inner_cols} {out_bytes / 1e9 / wall:>9.2f} "
                  f"{rss / 1e9:>12.2f} {rss / dense_bytes:>10.2f}")
        paired = [(s[0] / c[0], s[2] / c[0]) for s, c in zip(runs["stream"], runs["cp"])]
        print(f"\nstream / cp, run by run (each pair back to back): wall "
              f"{', '.join(f'{w:.2f}' for w, _ in paired)}; convert {', '.join(f'{c:.2f}' for _, c in paired)}; "
              f"median wall {statistics.median(w for w, _ in paired):.2f}, "
              f"convert {statistics.median(c for _, c in paired):.2f}")
        print("\nwall: the whole command, including ~5 s of Python and transformers start-up on this machine; "
              "convert: the conversion as `hf-moe convert` times it.")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
