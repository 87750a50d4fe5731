"""Peak memory of `hf-moe export` against the size of the model, each run in a fresh interpreter.

    python benchmarks/export_memory.py MOE_DIR [--other-pythonpath DIR] [--runs 1]

For each variant the child process imports torch, transformers and hf_moe, records its peak RSS (the baseline),
exports MOE_DIR to a temporary directory, and records its peak RSS again (VmHWM: every resident page counts, the
file pages a mapping touched included; not `ru_maxrss`, which a child keeps from the process that forked it).

Variants: `write` (`verify=False`: writing only), `default` (`verify=True`: every tensor read back, and the first
layers of the hf_moe model and of the export compared) and `full` (`verify="full"`: the whole models compared, one
loaded after the other). `--other-pythonpath` runs `write` and `default` with another hf_moe checkout first on the
path (e.g. /work/main, the code before streaming, whose only check compares the whole models), interleaved with
this one.

The model's size is the bytes of its safetensors files. The table gives peak RSS, its ratio to the model's size,
and the growth over the baseline, as median [min-max] over the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch, transformers
import hf_moe
from hf_moe import export_native
def rss():  # VmHWM: the peak RSS of this process's memory (ru_maxrss would keep the forking parent's)
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))
baseline = rss()
start = time.perf_counter()
result = export_native(sys.argv[1], sys.argv[2], verify={"write": False, "default": True, "full": "full"}[sys.argv[3]])
print(json.dumps({"baseline": baseline, "peak": rss(), "seconds": time.perf_counter() - start,
                  "diff": result.max_abs_logit_diff, "hf_moe": hf_moe.__file__}))
"""


def model_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def run(moe_dir: Path, verify: str, pythonpath: str | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), HF_HUB_OFFLINE="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="export-memory-") as tmp:
        out = subprocess.run(  # (cwd: not this checkout, which would come first on the path)
            [sys.executable, "-c", CHILD, str(moe_dir), str(Path(tmp) / "out"), verify],
            env=env, capture_output=True, text=True, check=False, cwd=tmp,
        )
    if out.returncode != 0:
        raise SystemExit(f"the export failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("moe_dir", type=Path)
    parser.add_argument("--other-pythonpath", default=None)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    size = model_bytes(args.moe_dir)
    code = {"this checkout": None}
    if args.other_pythonpath:
        code[args.other_pythonpath] = args.other_pythonpath
    results: dict[tuple[str, bool], list[dict]] = {}
    for _ in range(args.runs):  # interleaved: each run does every variant once
        for name, path in code.items():
            for verify in ("write", "default") + (("full",) if path is None else ()):
                results.setdefault((name, verify), []).append(run(args.moe_dir, verify, path))
    print(f"model: {args.moe_dir} ({size / 1e9:.3f} GB of safetensors), {args.runs} run(s) per variant\n")
    print("| code | verify | baseline RSS (GB) | peak RSS (GB) | peak / size | (peak - baseline) / size | max diff |")
    print("|---|---|---|---|---|---|---|")
    for (name, verify), runs in results.items():
        gb = lambda key: [r[key] / 1e9 for r in runs]  # noqa: E731
        ratio = [r["peak"] / size for r in runs]
        growth = [(r["peak"] - r["baseline"]) / size for r in runs]
        diff = runs[-1]["diff"]
        print(f"| {name} | {verify} | {spread(gb('baseline'), '.2f')} | {spread(gb('peak'), '.2f')} | "
              f"{spread(ratio, '.2f')} | {spread(growth, '.2f')} | {'-' if diff is None else f'{diff:.2e}'} |")
    print("\n" + json.dumps({f"{k[0]}|verify={k[1]}": v for k, v in results.items()}))


if __name__ == "__main__":
    main()
