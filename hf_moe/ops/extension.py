"""Finding or building the compiled CPU extension (csrc/), and saying why it is or is not used.

Order of preference:
  1. `hf_moe._C`, built ahead of time by `HF_MOE_BUILD_EXT=1 pip install --no-build-isolation -e .`;
  2. a build of csrc/ with `torch.utils.cpp_extension.load` (ninja), made on first use, once per user and machine,
     in `<cache>/ext/<hash>` (<cache>: $HF_MOE_CACHE, else $XDG_CACHE_HOME/hf_moe, ~/.cache/hf_moe, or a per-user
     directory in the temp dir: see build_cache.py); the hash covers the sources, Python, and the torch install
     (its path and binaries, not only its version: two venvs with one torch version keep two builds). A finished
     build is imported as it is, without running ninja again: neither another `ninja` on PATH nor another copy of
     the same sources (another checkout) rebuilds it;
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
import re
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
# What the build is made of: every C++ source and header under csrc/ (the same patterns ship them in the wheel,
# pyproject.toml's package-data), found on disk, so that a file added or changed there is built and changes the key.
SOURCE_PATTERNS = ("*.cpp",)
HEADER_PATTERNS = ("*.h",)


def manifest(patterns: tuple[str, ...], csrc: Path | None = None) -> list[str]:
    """The files under `csrc` (default: `CSRC`, recursively) whose names match `patterns`, as sorted POSIX paths
    relative to it."""
    csrc = CSRC if csrc is None else Path(csrc)
    found = {path.relative_to(csrc).as_posix() for pattern in patterns for path in csrc.rglob(pattern)
             if path.is_file()}
    return sorted(found)


CPU_SOURCES = manifest(SOURCE_PATTERNS)
HEADERS = manifest(HEADER_PATTERNS)
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
    from .build_cache import cache_root  # here, not above: setup.py runs this file alone, for the source lists

    return cache_root() / "ext"


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


def source_hash(torch_dir: str | os.PathLike | None = None, csrc: Path | None = None) -> str:
    """The build's cache key: every source and header under `csrc` (default: this package's csrc/; their paths and
    contents), the flags, Python, and the torch install (`torch_install_key`)."""
    csrc = CSRC if csrc is None else Path(csrc)
    h = hashlib.sha256()
    for name in manifest(HEADER_PATTERNS + SOURCE_PATTERNS, csrc):
        data = (csrc / name).read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())  # a renamed or moved file changes the key too
        h.update(data)
    h.update(f"{torch.__version__} {sys.version_info[:2]} {CXX_FLAGS}".encode())
    h.update(torch_install_key(torch_dir).encode())
    return h.hexdigest()[:16]


def build(verbose: bool = False):
    """Import the finished build of csrc/ from the cache, or compile it there with ninja first."""
    from torch.utils.cpp_extension import load

    sources = [str(CSRC / s) for s in manifest(SOURCE_PATTERNS)]
    digest = source_hash()
    name = f"hf_moe_ext_{digest}"
    build_dir = _cache_dir() / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{name}.so"
    with _exclusive(build_dir):
        if (build_dir / BUILT).is_file() and library.is_file():
            return _import_library(name, library), f"built in {build_dir}"
        estimate = build_estimate(build_dir.parent)
        start = time.monotonic()
        message = (f"hf_moe: compiling the C++ extension into {build_dir}, once per user and machine: {estimate} "
                   "(HF_MOE_BACKEND=torch skips it)")
        objects = [build_dir / f"{Path(source).stem}.o" for source in sources]  # (what ninja writes for each)
        with _elapsed(message, lambda: f"{sum(o.is_file() for o in objects)} of {len(objects)} files compiled"):
            module = load(name=name, sources=sources, build_directory=str(build_dir), extra_cflags=CXX_FLAGS,
                          extra_ldflags=["-fopenmp"], with_cuda=False, verbose=verbose)
        _write_atomically(build_dir / BUILT, f"{time.monotonic() - start:.0f}\n")
    return module, f"built in {build_dir}"


# Written in a build directory once its library is complete; holds the seconds the build took.
BUILT = "hf_moe-build.done"
# CPU seconds (user + sys) g++ -O3 spends on one translation unit, by whether it parses torch's ATen or torch headers
# (itself or through a csrc/ header it includes) or none (the pure-SIMD kernel files, and ops.cpp, which needs only
# c10's error macros and Python's C API); measured per file in docs/backends.md.
UNIT_S, SIMD_UNIT_S = 28, 5
LINK_S = 2
PROGRESS_EVERY_S = 30  # (a build's progress, in a log rather than on a terminal)


def compile_cpu_seconds(csrc: Path | None = None) -> list[float]:
    """The CPU seconds each source of the build (`manifest`) takes to compile, estimated from the torch headers it
    parses (`UNIT_S`, `SIMD_UNIT_S`)."""
    csrc = CSRC if csrc is None else Path(csrc)

    def includes(path: Path, seen: set[Path]) -> bytes:  # the file and every csrc/ header it reaches, concatenated
        if path in seen or not path.is_file():
            return b""
        seen.add(path)
        text = path.read_bytes()
        local = re.findall(rb'^\s*#\s*include\s+"([^"]+)"', text, flags=re.MULTILINE)
        return text + b"".join(includes((path.parent / name.decode()).resolve(), seen) for name in local)

    seconds = []
    for name in manifest(SOURCE_PATTERNS, csrc):
        text = includes((csrc / name).resolve(), set())
        seconds.append(UNIT_S if b"<ATen/" in text or b"<torch/" in text else SIMD_UNIT_S)
    return seconds


def build_estimate(ext_dir: Path) -> str:
    """How long a build will take, in words, as a range: from the compiles' CPU time (`compile_cpu_seconds`) spread
    over the cores ninja can use when they are idle, to that stretched by the machine's load ((load + cores) / cores,
    at least twice: other processes take cores while it builds); or what the last build on this machine took (another
    hash's, in `ext_dir`). Either way it says that a loaded machine takes longer (docs/backends.md: measured builds)."""
    done = sorted((p.stat().st_mtime, p) for p in ext_dir.glob(f"*/{BUILT}"))
    for _, path in reversed(done):
        try:
            seconds = float(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        return f"the last build here took {_minutes(seconds)}; longer if the machine is busier now"
    cores = int(os.environ.get("MAX_JOBS") or 0) or _usable_cores()  # torch passes MAX_JOBS to ninja as -j
    units = compile_cpu_seconds()
    idle = max(max(units), sum(units) / min(cores, len(units))) + LINK_S
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = max(2 * idle, idle * (load + cores) / cores)
    return (f"{_minutes(idle)} to {_minutes(busy)} on {cores} core{'s' if cores > 1 else ''} (load now {load:.0f}); "
            "longer on a loaded machine")


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} minutes"


def _import_library(name: str, path: Path):
    """Import a built extension module from its file (as torch's loader does once ninja is done)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(text)
    os.replace(staging, path)


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
def _elapsed(message: str, progress=None, enabled: bool = True):
    """Say what is being done, then how far it is while it runs (ninja says nothing until it is done): the time so
    far and `progress()` ("3 of 11 files compiled"), on one rewritten line each second on a terminal, else a line every
    PROGRESS_EVERY_S (a log); then how long it took."""
    if not enabled:
        yield
        return
    start = time.monotonic()
    live = sys.stderr.isatty()
    print(f"{message} ...", file=sys.stderr, end="" if live else "\n", flush=True)
    stop = threading.Event()

    def so_far() -> str:
        return f"{time.monotonic() - start:.0f} s" + (f", {progress()}" if progress is not None else "")

    def tick():
        while not stop.wait(1.0 if live else PROGRESS_EVERY_S):
            if live:
                print(f"\r{message} ... {so_far()}", file=sys.stderr, end="", flush=True)
            else:
                print(f"hf_moe: still compiling the C++ extension: {so_far()}", file=sys.stderr, flush=True)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
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


def load_extension() -> tuple[object | None, ExtensionStatus]:
    """The extension module (or None) and how it was found, under the current HF_MOE_BACKEND (read at each call, so a
    changed setting is honoured). Found or built once per process; warns once when it cannot be used, and raises
    under HF_MOE_BACKEND=compiled."""
    setting = backend_setting()
    if setting == "torch":
        return None, ExtensionStatus(False, "disabled by HF_MOE_BACKEND=torch")
    module, status, error = _find_or_build()
    reason = status.how.removeprefix("build failed: ")
    if module is None and setting == "compiled":
        raise RuntimeError(f"HF_MOE_BACKEND=compiled, but the extension failed to build ({reason}).") from error
    if module is None:
        _warn_fallback(reason)
    return module, status


@functools.cache
def _find_or_build() -> tuple[object | None, ExtensionStatus, Exception | None]:
    """(module or None, how it was found or why not, the build's error) for this process: tried once."""
    module = _prebuilt()
    how = "prebuilt hf_moe._C (HF_MOE_BUILD_EXT=1 pip install)"
    if module is None:
        try:
            module, how = build()
        except Exception as err:  # a compiler problem must not stop the model from running
            reason = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
            return None, ExtensionStatus(False, f"build failed: {reason}"), err
    return module, ExtensionStatus(True, how), None


@functools.cache  # once per process
def _warn_fallback(reason: str) -> None:
    warnings.warn(
        f"hf_moe: the compiled extension could not be built ({reason}); running the pure-torch ops "
        "instead (correct, slower). Set HF_MOE_BACKEND=torch to silence this, or see "
        "`python -m hf_moe.env`.",
        RuntimeWarning,
        stacklevel=4,
    )
