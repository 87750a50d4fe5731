"""Finding or building the compiled CPU extension (csrc/), and saying why it is or is not used.

Order of preference:
  1. `hf_moe._C`, built ahead of time by `HF_MOE_BUILD_EXT=1 pip install --no-build-isolation -e .`;
  2. a build of csrc/ with `torch.utils.cpp_extension.load` (ninja), made on first use and cached in
     `$HF_MOE_CACHE/ext/<hash>` (default ~/.cache/hf_moe); the hash covers the sources, Python, and the torch
     install (its path and binaries, not only its version: two venvs with one torch version keep two builds);
  3. nothing: the pure-torch ops run, after one warning that says why.

`HF_MOE_BACKEND=torch` skips 1 and 2; `HF_MOE_BACKEND=compiled` makes a failure an error.
The extension holds C++ kernels for CPU tensors only (TORCH_LIBRARY_IMPL): the ops' schemas, shape functions and
backward formulas are defined in Python when hf_moe is imported (library.py). CUDA tensors run the pure-torch ops
by default (backend.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import logging
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("hf_moe")

_HERE = Path(__file__).resolve()
# csrc/ at the top of a source checkout (and of editable installs); inside the package (hf_moe/csrc) in a wheel.
CSRC = _HERE.parents[2] / "csrc" if (_HERE.parents[2] / "csrc" / "ops.cpp").is_file() else _HERE.parents[1] / "csrc"
CPU_SOURCES = ["ops.cpp", "cpu/dispatch_cpu.cpp", "cpu/experts_cpu.cpp", "cpu/fused_cpu.cpp",
               "cpu/serve_cpu.cpp", "cpu/serve_kernels.cpp", "cpu/decode_cpu.cpp", "cpu/decode_kernels.cpp"]
HEADERS = ["hf_moe.h", "cpu/activation_cpu.h", "cpu/serve_kernels.h", "cpu/simd_avx512.h", "cpu/decode_kernels.h"]
CXX_FLAGS = ["-O3", "-fopenmp"]


@dataclass(frozen=True)
class ExtensionStatus:
    loaded: bool
    how: str  # "prebuilt hf_moe._C", "built in <dir>", or why not


def backend_setting() -> str:
    """HF_MOE_BACKEND: auto (default), compiled, triton or torch (see hf_moe/ops/__init__.py)."""
    value = os.environ.get("HF_MOE_BACKEND", "auto").lower()
    if value not in ("auto", "torch", "compiled", "triton"):
        raise ValueError(f"HF_MOE_BACKEND must be auto, compiled, triton or torch, got {value!r}.")
    return value


def _cache_dir() -> Path:
    return Path(os.environ.get("HF_MOE_CACHE", Path.home() / ".cache" / "hf_moe")) / "ext"


def torch_install_key(torch_dir: str | os.PathLike | None = None) -> str:
    """Which torch install a build links against: where it is, and the size and time of its binaries. Two
    environments with the same torch version then keep separate builds (instead of rebuilding in turn), and a
    reinstall of torch in place rebuilds. `torch_dir`: the torch package directory (default: the imported one)."""
    torch_dir = Path(os.path.realpath(torch_dir or Path(torch.__file__).parent))
    parts = [str(torch_dir), str(getattr(torch.version, "git_version", ""))]
    for pattern in ("_C.*", "lib/libtorch*", "lib/libc10*"):
        for path in sorted(torch_dir.glob(pattern)):
            if path.is_file():
                stat = path.stat()
                parts.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return "\n".join(parts)


def source_hash(torch_dir: str | os.PathLike | None = None) -> str:
    """The build's cache key: the sources, the flags, Python, and the torch install (`torch_install_key`)."""
    h = hashlib.sha256()
    for path in [*(CSRC / s for s in HEADERS), *(CSRC / s for s in CPU_SOURCES)]:
        h.update(path.read_bytes())
    h.update(f"{torch.__version__} {sys.version_info[:2]} {CXX_FLAGS}".encode())
    h.update(torch_install_key(torch_dir).encode())
    return h.hexdigest()[:16]


def build(verbose: bool = False):
    """Compile csrc/ with ninja into the cache (or reuse a previous build) and import it."""
    from torch.utils.cpp_extension import load

    sources = [str(CSRC / s) for s in CPU_SOURCES]
    digest = source_hash()
    build_dir = _cache_dir() / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(build_dir):
        fresh = not (build_dir / f"hf_moe_ext_{digest}.so").exists()
        what = f"the C++ extension ({len(sources)} files)"
        with _elapsed(f"hf_moe: compiling {what}, once for this torch; HF_MOE_BACKEND=torch skips it", enabled=fresh):
            module = load(
                name=f"hf_moe_ext_{digest}",
                sources=sources,
                build_directory=str(build_dir),
                extra_cflags=CXX_FLAGS,
                extra_ldflags=["-fopenmp"],
                with_cuda=False,
                verbose=verbose,
            )
    return module, f"built in {build_dir}"


@contextlib.contextmanager
def _exclusive(build_dir: Path):
    """Hold an exclusive `flock` on the build directory while building or loading a build. The kernel releases it
    when its process dies, unlike the `lock` file torch's builder creates, which a build killed midway leaves
    behind and every later process then waits on forever: under the flock no other hf_moe process is building,
    so such a file is stale and goes."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's own lock file only
        yield
        return
    with open(build_dir / "hf_moe-build.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"hf_moe: another process is building the extension in {build_dir}; waiting for it.",
                  file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"  # torch.utils.cpp_extension's FileBaton
        if stale.exists():
            stale.unlink()
            print(f"hf_moe: removed {stale}, left by a build of the extension that was killed.", file=sys.stderr)
        yield


@contextlib.contextmanager
def _elapsed(message: str, enabled: bool = True):
    """Say what is being done and, on a terminal, how long it has taken so far (a compile has no honest ETA: ninja
    does not say how far it is); then how long it took."""
    if not enabled:
        yield
        return
    start = time.monotonic()
    live = sys.stderr.isatty()
    print(f"{message} ...", file=sys.stderr, end="" if live else "\n", flush=True)
    stop = threading.Event()

    def tick():
        while not stop.wait(1.0):
            print(f"\r{message} ... {time.monotonic() - start:.0f} s", file=sys.stderr, end="", flush=True)

    ticker = threading.Thread(target=tick, daemon=True) if live else None
    if ticker is not None:
        ticker.start()
    try:
        yield
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
        print(f"\r{message}: done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


def _prebuilt():
    """hf_moe._C if it was built from the current sources, else None (a stale one is not even imported)."""
    spec = importlib.util.find_spec("hf_moe._C")
    if spec is None or spec.origin is None:
        return None
    data = Path(spec.origin).read_bytes()
    marker = b"hf_moe_source_hash="
    at = data.find(marker)
    stamp = data[at + len(marker) : at + len(marker) + 16].decode(errors="replace") if at >= 0 else ""
    if stamp != source_hash():
        logger.warning("hf_moe: the prebuilt hf_moe._C was built from other sources; building the current ones "
                       "on first use. Rebuild it with `HF_MOE_BUILD_EXT=1 pip install --no-build-isolation -e .`.")
        return None
    return importlib.import_module("hf_moe._C")


@functools.cache
def load_extension() -> tuple[object | None, ExtensionStatus]:
    """The extension module (or None) and how it was found. Warns once when it cannot be used."""
    setting = backend_setting()
    if setting == "torch":
        return None, ExtensionStatus(False, "disabled by HF_MOE_BACKEND=torch")
    module = _prebuilt()
    how = "prebuilt hf_moe._C (HF_MOE_BUILD_EXT=1 pip install)"
    if module is None:
        try:
            module, how = build()
        except Exception as err:  # a compiler problem must not stop the model from running
            reason = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
            if setting == "compiled":
                raise RuntimeError(f"HF_MOE_BACKEND=compiled, but the extension failed to build ({reason}).") from err
            warnings.warn(
                f"hf_moe: the compiled extension could not be built ({reason}); running the pure-torch ops "
                "instead (correct, slower). Set HF_MOE_BACKEND=torch to silence this, or see "
                "`python -m hf_moe.env`.",
                RuntimeWarning,
                stacklevel=3,
            )
            return None, ExtensionStatus(False, f"build failed: {reason}")
    return module, ExtensionStatus(True, how)
