"""Building and choosing the compiled (C++, CPU) extension: on first use, ahead of time, or not at all, with a clear
word about which backend runs; a failed build falls back to the pure-torch ops with one warning."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_moe.ops import backend_report, infer, load_extension
from hf_moe.ops.build_cache import NoBuildCache, cache_root
from hf_moe.ops import extension
from hf_moe.ops.extension import BUILT, CPU_SOURCES, CSRC, HEADERS, build_estimate, source_hash

ROOT = Path(__file__).resolve().parents[1]

# A tiny MoE forward+backward in a fresh process; prints the backend that ran.
_RUN = """
import warnings, torch
warnings.simplefilter("always")
from hf_moe import MoEConfig, SparseMoeBlock
from hf_moe.ops import dispatch_ops
from transformers import LlamaConfig
config = MoEConfig.from_base(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2), num_experts=4, num_experts_per_tok=2)
block = SparseMoeBlock(config)
for _ in range(3):
    block(torch.randn(2, 5, 16, requires_grad=True)).sum().backward()
print("backend:", dispatch_ops(torch.device("cpu"), "silu").name)
"""


def _run(fresh_python, env: dict, code: str = _RUN) -> subprocess.CompletedProcess:
    """`code` in a process that has not imported hf_moe, with the variables `env` sets."""
    return fresh_python.run(code, set_env=env, cwd=ROOT, timeout=600)


def test_compiled_backend_is_active_here():
    module, status = load_extension()
    assert module is not None, status.how
    assert backend_report()["experts (whole layer)"][0].startswith("compiled C++")
    # `python -m hf_moe.env` names the inference kernel set and the weights it takes on this CPU
    inference, why = backend_report()["experts, inference"]
    assert f"({infer.kernel_isa()} kernels)" in inference and "int8" in inference
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        assert (name in inference) == infer.serves(dtype), (inference, why)
    # and what a prompt's bf16 linear layers run on in hf_moe's own generate loop (hf_moe.ops.prefill_linears)
    linears, why = backend_report()["prompt's bf16 linears"]
    assert ("linear_infer" in linears) == (infer.kernel_isa() == "avx2"), (linears, why)


@pytest.mark.subprocess
def test_backend_torch_skips_the_extension(fresh_python, tmp_path):
    result = _run(fresh_python, {"HF_MOE_BACKEND": "torch", "HF_MOE_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "backend: torch" in result.stdout
    assert not any(tmp_path.iterdir())  # nothing was built
    env = _run(fresh_python, {"HF_MOE_BACKEND": "torch"}, "import hf_moe.env as e; print(e.report())")
    assert "disabled by HF_MOE_BACKEND=torch" in env.stdout


@pytest.fixture
def stub_csrc(tmp_path) -> Path:
    """Sources that make a module with no kernels, compiled in a second or two: what the build's machinery (the cache,
    its locks, ninja) is tested on, instead of a second full build of csrc/ (minutes). A process reads them as its
    sources through `_with_sources`; a prebuilt hf_moe._C, stamped with csrc/'s hash, is stale for them and refused."""
    stub = tmp_path / "stub_csrc"
    stub.mkdir()
    (stub / "ops.cpp").write_text(
        f"// {tmp_path}: a hash of this test's own (torch renames a second build of one name in a process)\n"
        "#include <Python.h>\n"
        "#define HF_MOE_STR2(x) #x\n#define HF_MOE_STR(x) HF_MOE_STR2(x)\n"
        "#define HF_MOE_INIT2(x) PyInit_##x\n#define HF_MOE_INIT(x) HF_MOE_INIT2(x)\n"
        "static PyModuleDef stub = {PyModuleDef_HEAD_INIT, HF_MOE_STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};\n"
        "PyMODINIT_FUNC HF_MOE_INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&stub); }\n"
    )
    return stub


def _with_sources(csrc: Path, code: str) -> str:
    """`code` in a process whose extension is built from `csrc` (as the `csrc_copy` fixture does in this one)."""
    return f"from pathlib import Path\nfrom hf_moe.ops import extension\nextension.CSRC = Path({str(csrc)!r})\n{code}"


@pytest.mark.subprocess
def test_failed_build_falls_back_with_one_warning(fresh_python, tmp_path, stub_csrc):
    result = _run(fresh_python, {"HF_MOE_CACHE": str(tmp_path), "CXX": "/bin/false", "CC": "/bin/false"},
                  _with_sources(stub_csrc, _RUN))
    assert result.returncode == 0, result.stderr
    assert "backend: torch" in result.stdout
    assert result.stderr.count("could not be built") == 1, result.stderr
    forced = _run(fresh_python, {"HF_MOE_CACHE": str(tmp_path / "2"), "CXX": "/bin/false",
                                 "HF_MOE_BACKEND": "compiled"},
                  _with_sources(stub_csrc, _RUN))
    assert forced.returncode != 0 and "HF_MOE_BACKEND=compiled" in forced.stderr


@pytest.mark.subprocess
def test_bad_backend_setting_is_an_error(fresh_python):
    result = _run(fresh_python, {"HF_MOE_BACKEND": "fast"})
    assert result.returncode != 0 and "HF_MOE_BACKEND must be auto, compiled, triton or torch" in result.stderr


def test_source_hash_covers_the_sources():
    assert all((CSRC / s).is_file() for s in CPU_SOURCES)
    assert not (CSRC / "cuda").exists()  # CUDA runs the Triton kernels (tests/test_triton.py), not C++
    assert len(source_hash()) == 16


def test_the_build_manifest_is_every_file_under_csrc():
    """The sources and headers are found on disk, not kept in a list by hand (a hand-kept list left a header out of
    the cache key); every file there is in the manifest, and pyproject's package-data ships each of them."""
    import glob
    import tomllib

    on_disk = {p.relative_to(CSRC).as_posix() for p in CSRC.rglob("*")
               if p.is_file() and p.name != "__init__.py" and "__pycache__" not in p.parts}
    assert set(CPU_SOURCES) | set(HEADERS) == on_disk
    assert "cpu/decode_ops.h" in HEADERS and "ops.cpp" in CPU_SOURCES
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["hf_moe.csrc"]
    shipped = {name for pattern in patterns for name in glob.glob(pattern, root_dir=CSRC, recursive=True)}
    assert on_disk <= shipped, sorted(on_disk - shipped)


@pytest.fixture
def csrc_copy(tmp_path, monkeypatch) -> Path:
    """A copy of csrc/ that the extension module reads as its sources (the real tree is left alone)."""
    import shutil

    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy, ignore=shutil.ignore_patterns("__pycache__", "__init__.py"))
    monkeypatch.setattr(extension, "CSRC", copy)
    return copy


def test_changing_any_file_under_csrc_changes_the_cache_key(csrc_copy):
    """A change to any source or header (csrc/cpu/decode_ops.h was left out) is a new build, not a stale one loaded;
    so is a file added or renamed."""
    before = source_hash()
    files = sorted(p for p in csrc_copy.rglob("*") if p.is_file())
    assert csrc_copy / "cpu" / "decode_ops.h" in files
    for path in files:
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        assert source_hash() != before, f"a change to {path.relative_to(csrc_copy)} keeps the cache key"
        path.write_bytes(original)
    assert source_hash() == before
    (csrc_copy / "cpu" / "decode_ops.h").rename(csrc_copy / "cpu" / "decode_ops2.h")
    assert source_hash() != before
    (csrc_copy / "cpu" / "decode_ops2.h").rename(csrc_copy / "cpu" / "decode_ops.h")
    (csrc_copy / "cpu" / "new_kernels.cpp").write_text("// a source another change adds\n")
    assert source_hash() != before


def test_the_compile_estimate_counts_every_source(csrc_copy):
    """The first build's estimate adds up the compiles of the sources the build compiles, not of a list that had
    fallen behind it (6 of 10)."""
    sources = extension.manifest(extension.SOURCE_PATTERNS)
    seconds = extension.compile_cpu_seconds()
    assert len(seconds) == len(sources) == len(list(csrc_copy.rglob("*.cpp")))
    assert set(seconds) == {extension.UNIT_S, extension.SIMD_UNIT_S}  # ATen's parsers; ops.cpp and the SIMD kernels
    (csrc_copy / "cpu" / "new_kernels.cpp").write_text("#include <torch/library.h>\n")
    assert sum(extension.compile_cpu_seconds()) == sum(seconds) + extension.UNIT_S


@pytest.mark.subprocess
@pytest.mark.slow
def test_ahead_of_time_build_with_setup_py(fresh_python, tmp_path, stub_csrc):
    """HF_MOE_BUILD_EXT=1 builds hf_moe._C, stamped with the hash of its sources and without debug information; the
    loader takes it, its ops run, and it is refused (not even imported) for other sources. The build checked is the
    installed one where it is current (scripts/test.sh installs so, and the whole suite runs on it: CI compiles
    csrc/ once), else one made here with setup.py."""
    import importlib.util

    spec = importlib.util.find_spec("hf_moe._C")
    installed = Path(spec.origin) if spec is not None and spec.origin else None
    if installed is not None and f"hf_moe_source_hash={source_hash()}".encode() in installed.read_bytes():
        so, on_path = installed, ""
    else:
        env = {**os.environ, "HF_MOE_BUILD_EXT": "1"}
        build = subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
             "--build-temp", str(tmp_path / "tmp")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
        )
        assert build.returncode == 0, build.stderr[-3000:]
        (so,) = (tmp_path / "lib" / "hf_moe").glob("_C*.so")
        assert f"hf_moe_source_hash={source_hash()}".encode() in so.read_bytes()
        on_path = f"hf_moe.__path__.append({str(so.parent)!r})  # where this build put hf_moe._C"
    # Built as the on-first-use build is, without setuptools' -g: debug information made the library many times
    # bigger and its compile slower, for the same machine code (docs/backends.md).
    assert b".debug_info" not in so.read_bytes(), f"{so} holds debug information; rebuild it (setup.py's docstring)"
    check = _run(fresh_python, {"HF_MOE_BACKEND": "compiled"}, f"""
import sys, torch, hf_moe
{on_path}
from hf_moe.ops import load_extension
print(load_extension()[1].how)
print(sys.modules["hf_moe._C"].__file__)
ids = torch.tensor([[2, 0], [1, 2]])
print(torch.ops.hf_moe.sort_by_expert(ids, 3)[2].tolist())
""")
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.splitlines() == ["prebuilt hf_moe._C (HF_MOE_BUILD_EXT=1 pip install)", str(so), "[1, 1, 2]"]
    stale = _run(fresh_python, {}, _with_sources(stub_csrc, f"""
import sys, hf_moe
{on_path}
print(extension._prebuilt() is None, "hf_moe._C" in sys.modules)
"""))
    assert stale.returncode == 0, stale.stderr[-3000:]
    assert stale.stdout.split() == ["True", "False"] and "built from other sources" in stale.stderr, stale.stderr


@pytest.mark.subprocess
def test_a_build_killed_midway_does_not_block_the_next_load(fresh_python, tmp_path, stub_csrc, finished_build):
    """torch's builder holds a `lock` file while it builds; a build killed midway left it, and every later process
    waited on it forever. Under hf_moe's own flock (released when a process dies) such a file is stale and goes."""
    import shutil

    built = finished_build
    cache = tmp_path / "cache"
    # (without the mark of a finished build: a killed build never wrote it)
    shutil.copytree(built, cache / "ext" / built.name, ignore=shutil.ignore_patterns("lock", "*.lock", BUILT))
    (cache / "ext" / built.name / "lock").touch()  # as a killed build leaves it
    result = _run(fresh_python, {"HF_MOE_CACHE": str(cache), "HF_MOE_BACKEND": "compiled"},
                  _with_sources(stub_csrc, _LOAD))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"built in {cache / 'ext' / built.name}"
    assert "left by a build of the extension that was killed" in result.stderr
    assert not (cache / "ext" / built.name / "lock").exists()


# --------------------------------------------------------------------------------------------------------------
# One build per user and machine: where it lives, and a finished build reused as it is
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture
def finished_build(tmp_path, stub_csrc, monkeypatch) -> Path:
    """A finished build of `stub_csrc` (made here, in a second or two), to copy into the caches the tests set up;
    their processes read `stub_csrc` as their sources (`_with_sources`)."""
    monkeypatch.setattr(extension, "CSRC", stub_csrc)
    monkeypatch.setenv("HF_MOE_CACHE", str(tmp_path / "finished"))
    _, how = extension.build()
    built = tmp_path / "finished" / "ext" / source_hash()
    assert how == f"built in {built}" and (built / BUILT).is_file()
    return built


def _no_home_env(tmp_path: Path) -> dict:
    """A service user's environment: $HOME cannot hold a cache (under a file: even root cannot write there), no
    $HF_MOE_CACHE or $XDG_CACHE_HOME, and a temp dir of the test's own."""
    (tmp_path / "not-a-dir").write_text("")
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {"HOME": str(tmp_path / "not-a-dir" / "home"), "TMPDIR": str(tmp_path / "tmp"), "HF_MOE_CACHE": "",
            "XDG_CACHE_HOME": ""}


_LOAD = "from hf_moe.ops import load_extension; print(load_extension()[1].how)"


@pytest.mark.subprocess
def test_unwritable_home_caches_the_build_in_a_private_temp_dir(fresh_python, tmp_path, stub_csrc, finished_build):
    """A service user whose $HOME is not writable rebuilt the extension in every process (minutes each).
    The build now goes to <temp dir>/hf_moe-<uid> (mode 700), where the next process finds it: here a
    finished build put there, which two processes load without compiling (no compiler, no ninja)."""
    import shutil

    env = _no_home_env(tmp_path)
    private = tmp_path / "tmp" / f"hf_moe-{os.getuid()}"
    where = _run(fresh_python, env, "from hf_moe.ops.build_cache import cache_root; print(cache_root())")
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip() == str(private) and (private.stat().st_mode & 0o777) == 0o700
    shutil.copytree(finished_build, private / "ext" / finished_build.name)
    no_tools = {**env, "HF_MOE_BACKEND": "compiled", "CXX": "/bin/false", "PATH": os.path.dirname(sys.executable)}
    for _ in range(2):
        result = _run(fresh_python, no_tools, _with_sources(stub_csrc, _LOAD))
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == f"built in {private / 'ext' / finished_build.name}"
        assert "compiling" not in result.stderr


@pytest.mark.subprocess
def test_a_finished_build_runs_no_ninja(fresh_python, tmp_path, stub_csrc, finished_build):
    """torch's loader runs ninja in every new process; another ninja on PATH (a venv's against the system's) or
    another checkout of the same sources then rebuilt everything. A finished build is now imported as it is."""
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(finished_build, cache / "ext" / finished_build.name)
    (tmp_path / "bin").mkdir()
    ninja = tmp_path / "bin" / "ninja"
    ninja.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ninja-ran'}\nexit 1\n")
    ninja.chmod(0o755)
    env = {"HF_MOE_CACHE": str(cache), "HF_MOE_BACKEND": "compiled",
           "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    result = _run(fresh_python, env, _with_sources(stub_csrc, _LOAD))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"built in {cache / 'ext' / finished_build.name}"
    assert not (tmp_path / "ninja-ran").exists()


def test_the_shared_temp_dir_is_used_only_when_private(tmp_path, monkeypatch):
    """<temp dir>/hf_moe-<uid> is shared ground: a directory someone else made there (open to others, a link, or
    another user's) could hold a planted library. It is used only when it is this user's alone."""
    import tempfile

    for name, value in _no_home_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    private = tmp_path / "tmp" / f"hf_moe-{os.getuid()}"
    private.mkdir(mode=0o700)
    assert cache_root() == private
    private.chmod(0o777)
    with pytest.raises(NoBuildCache, match="open to other users .mode 777; it must be 700"):
        cache_root()
    private.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    private.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NoBuildCache, match="is not a directory .a link"):
        cache_root()
    private.unlink()
    if os.getuid() == 0:  # only root can give a directory away
        private.mkdir(mode=0o700)
        os.chown(private, 65534, 65534)
        with pytest.raises(NoBuildCache, match="belongs to another user"):
            cache_root()
    monkeypatch.setenv("HF_MOE_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


@pytest.mark.subprocess
def test_a_failed_cache_runs_the_torch_ops_and_says_how_to_fix_it(fresh_python, tmp_path, stub_csrc):
    """No usable cache (no $HOME, an unsafe temp dir) for sources that need a build (the stub's: a prebuilt
    hf_moe._C is stale for them): one warning naming HF_MOE_CACHE, and the pure-torch ops, not a build in every
    process."""
    env = _no_home_env(tmp_path)
    (tmp_path / "tmp" / f"hf_moe-{os.getuid()}").mkdir(mode=0o777)
    os.chmod(tmp_path / "tmp" / f"hf_moe-{os.getuid()}", 0o777)
    result = _run(fresh_python, env, _with_sources(stub_csrc, _RUN))
    assert result.returncode == 0, result.stderr
    assert "backend: torch" in result.stdout and "set HF_MOE_CACHE to a writable directory" in result.stderr
    assert "compiling" not in result.stderr


def test_the_first_build_says_how_long_it_will_take(tmp_path):
    """One line at the first build says how long it will take, as a range that says a loaded machine takes longer (it
    said "about 40 s" for a build that took 212 s on a busy machine): the compiles' measured CPU time over the cores
    ninja gets, idle to loaded; else the last build on this machine."""
    ext = tmp_path / "ext"
    (ext / "abc").mkdir(parents=True)
    text = build_estimate(ext)
    assert re.fullmatch(r"\d+ (s|minutes) to \d+ (s|minutes) on \d+ cores? \(load now \d+\); longer on a loaded machine",
                        text), text
    (ext / "abc" / BUILT).write_text("250\n")
    assert build_estimate(ext) == "the last build here took 4 minutes; longer if the machine is busier now"


def test_the_build_says_how_far_it_is_while_it_runs(capsys, monkeypatch):
    """ninja says nothing until it is done: the build reports the time so far and the files compiled, in a log too."""
    monkeypatch.setattr(extension, "PROGRESS_EVERY_S", 0.05)
    with extension._elapsed("hf_moe: compiling the C++ extension", lambda: "3 of 11 files compiled"):
        time.sleep(0.5)
    err = capsys.readouterr().err
    assert re.search(r"\nhf_moe: still compiling the C\+\+ extension: \d+ s, 3 of 11 files compiled\n", err), err
    assert re.search(r"done in \d+ s$", err.rstrip()), err
