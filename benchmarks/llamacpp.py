"""llama.cpp for benchmarks/serve_cpu.py: installed from the public registries into a cache directory (never into the
project), its GGUF converter, and the client of the Node worker (benchmarks/llamacpp_bench.mjs).

    python benchmarks/llamacpp.py setup [--dir DIR]              # npm + PyPI, a few minutes, about 1.5 GB in DIR
    python benchmarks/llamacpp.py convert MIXTRAL_DIR OUT_DIR [--types f32,f16,q8_0] [--dir DIR]

DIR defaults to ~/.cache/hf_moe/llamacpp and holds:

    node_modules/node-llama-cpp   the npm package node-llama-cpp 3.21.1 with its prebuilt llama.cpp (CPU binaries for
                                  x64 variants from SSE4.2 to AVX512/AMX; the best one for this CPU loads at run time)
    llama_cpp_python-0.3.23/      the llama-cpp-python sdist from PyPI, for the converter it vendors:
                                  vendor/llama.cpp/convert_hf_to_gguf.py
    venv/                         the converter's own venv: torch (the build this interpreter runs), transformers,
                                  gguf and sentencepiece from PyPI

The converter reads a Hugging Face directory of a transformers-native architecture, so an hf_moe model goes through
`hf-moe export` (Mixtral for a Llama base) first; llama.cpp then loads it as its own MoE (8 experts, 2 used).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

from workers import Worker  # benchmarks/workers.py

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hf_moe", "llamacpp")
NODE_PACKAGE = "node-llama-cpp@3.21.1"
CONVERTER_SDIST = "llama-cpp-python==0.3.23"
SDIST_DIR = "llama_cpp_python-0.3.23"
CONVERTER = os.path.join(SDIST_DIR, "vendor", "llama.cpp", "convert_hf_to_gguf.py")
WORKER = os.path.join(HERE, "llamacpp_bench.mjs")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")


def node_missing() -> str | None:
    """Why llama.cpp cannot run here (no Node.js), or None."""
    if shutil.which("node") is None:
        return "Node.js is not installed (`node` is not on PATH): llama.cpp runs through the npm package node-llama-cpp"
    return None


def installed(directory: str = DEFAULT_DIR) -> str | None:
    """Why the llama.cpp install in `directory` is not usable, or None when it is."""
    why = node_missing()
    if why:
        return why
    if not os.path.isfile(os.path.join(directory, "node_modules", "node-llama-cpp", "package.json")):
        return f"node-llama-cpp is not installed in {directory} (run: python benchmarks/llamacpp.py setup)"
    if not os.path.isfile(os.path.join(directory, CONVERTER)) or not os.path.isfile(_venv_python(directory)):
        return f"the GGUF converter is not set up in {directory} (run: python benchmarks/llamacpp.py setup)"
    return None


def _venv_python(directory: str) -> str:
    return os.path.join(directory, "venv", "bin", "python")


def _run(cmd: list[str], **kwargs) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def setup(directory: str = DEFAULT_DIR) -> None:
    """Install node-llama-cpp (npm) and the converter (PyPI sdist + a venv of its own) into `directory`."""
    why = node_missing()
    if why:
        raise SystemExit(f"cannot set up llama.cpp: {why}. Install Node.js 20 or newer (with npm) first.")
    import torch

    os.makedirs(directory, exist_ok=True)
    if not os.path.isfile(os.path.join(directory, "package.json")):
        with open(os.path.join(directory, "package.json"), "w") as f:
            json.dump({"name": "hf-moe-llamacpp", "private": True}, f)
    # The prebuilt binaries come as optional dependencies (@node-llama-cpp/linux-x64, ...): no build, no postinstall.
    _run(["npm", "install", "--no-audit", "--no-fund", NODE_PACKAGE], cwd=directory)
    sdist_dir = os.path.join(directory, "sdist")
    if not os.path.isfile(os.path.join(directory, CONVERTER)):
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps", CONVERTER_SDIST,
              "-d", sdist_dir])
        (archive,) = [os.path.join(sdist_dir, n) for n in os.listdir(sdist_dir) if n.endswith(".tar.gz")]
        wanted = (f"{SDIST_DIR}/vendor/llama.cpp/convert_hf_to_gguf.py", f"{SDIST_DIR}/vendor/llama.cpp/gguf-py/")
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(wanted) and (m.isfile() or m.isdir())]
            tar.extractall(directory, members=members, filter="data")
    python = _venv_python(directory)
    if not os.path.isfile(python):
        _run([sys.executable, "-m", "venv", os.path.join(directory, "venv")])
    import transformers

    torch_version = torch.__version__.split("+")[0]  # the build this interpreter runs (a CPU build: no CUDA wheels)
    _run([python, "-m", "pip", "install", "--quiet", f"torch=={torch_version}"])
    _run([python, "-m", "pip", "install", "--quiet", f"transformers=={transformers.__version__}", "gguf",
          "sentencepiece", "safetensors", "numpy", "protobuf"])
    print(f"llama.cpp is set up in {directory}", file=sys.stderr)


def convert(native_dir: str, out_dir: str, types=("f32", "f16", "q8_0"), directory: str = DEFAULT_DIR) -> dict:
    """GGUF files of a transformers-native model directory, one per type, written once: {type: path}."""
    why = installed(directory)
    if why:
        raise RuntimeError(why)
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for kind in types:
        if kind not in GGUF_TYPES:
            raise ValueError(f"GGUF type must be one of {', '.join(GGUF_TYPES)}, got {kind!r}")
        path = os.path.join(out_dir, f"model-{kind}.gguf")
        if not os.path.isfile(path):
            start = time.perf_counter()
            # gguf from PyPI (NO_LOCAL_GGUF), as the published runs used, rather than the copy vendored beside the script
            env = dict(os.environ, NO_LOCAL_GGUF="1")
            cmd = [_venv_python(directory), os.path.join(directory, CONVERTER), native_dir, "--outtype", kind,
                   "--outfile", path + ".part"]
            print(f"converting {native_dir} to GGUF {kind} ...", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            os.replace(path + ".part", path)
            print(f"  {path}: {os.path.getsize(path) / 2**20:,.0f} MiB in {time.perf_counter() - start:.0f}s",
                  file=sys.stderr, flush=True)
        paths[kind] = path
    return paths


def llamacpp_worker(gguf: str, threads: int, context: int, directory: str = DEFAULT_DIR, name: str = "") -> Worker:
    return Worker(["node", WORKER, directory, gguf, str(threads), str(context)], name or os.path.basename(gguf))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("setup", help="install node-llama-cpp and the GGUF converter into --dir")
    s.add_argument("--dir", default=DEFAULT_DIR)
    c = sub.add_parser("convert", help="GGUF files of a transformers-native model directory")
    c.add_argument("native_dir")
    c.add_argument("out_dir")
    c.add_argument("--types", default="f32,f16,q8_0")
    c.add_argument("--dir", default=DEFAULT_DIR)
    args = p.parse_args()
    if args.command == "setup":
        setup(args.dir)
    else:
        for kind, path in convert(args.native_dir, args.out_dir, args.types.split(","), args.dir).items():
            print(f"{kind}\t{path}")


if __name__ == "__main__":
    main()
