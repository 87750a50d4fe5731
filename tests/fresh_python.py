"""`python -c CODE` for the tests that need a process hf_moe has not been imported into, at a fraction of a
fresh interpreter's cost (the `fresh_python` fixture of conftest.py).

Such a process spent most of its time importing transformers' model code (about 8 s of CPU on a 2-core machine, and
the suite started some forty). Here the child is forked from a server (hf_moe/forkserver.py, started by path) that
has imported torch and transformers' model code, and nothing of hf_moe: what hf_moe does at import and on first use
(registering its classes, choosing and loading its backend, reading HF_MOE_* variables) happens in the child, as in
a fresh process.

A run's environment is the session's when it started (before a test or a library it runs changed os.environ; the
server's too) with the run's `set_env` on top. A fork stands in for a fresh interpreter only where it cannot differ,
so a run goes to a fresh interpreter when:
  * `set_env` changes anything but hf_moe's own variables and the compilers (HF_MOE_*, CC, CXX: read when hf_moe
    builds, after the fork; torch, transformers and huggingface_hub read others at import);
  * the server cannot fork (it runs a thread: `forkserver.why_not_fork`).
It is not for what a fork would measure or hide: peak memory (the server's pages count in the child's), interpreter
options (-W, -X), or what torch and transformers do at import.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from readme_zygote import forkserver

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ["import transformers.modeling_utils"]  # (and torch, which it imports)


def _read_after_the_fork(name: str) -> bool:
    """Whether nothing the server imported reads the variable `name` (hf_moe's own, and the compilers of its build)."""
    return name.startswith("HF_MOE_") or name in ("CC", "CXX")


class FreshPython:
    """`run(code, *args, set_env=None, cwd=ROOT, timeout=600)`: what `subprocess.run([python, "-c", code, *args],
    env=baseline | set_env, capture_output=True, text=True, ...)` returns (stdout and stderr apart, stdin /dev/null),
    or raises (subprocess.TimeoutExpired). `baseline`: the session's environment at its start."""

    def __init__(self, folder: Path, baseline: dict[str, str]):
        self._folder, self._baseline, self._server, self._runs = folder, dict(baseline), None, 0
        self.forked = 0  # runs that were forked (the others ran fresh)

    def run(self, code: str, *args, set_env: dict[str, str] | None = None, cwd: str | Path = ROOT,
            timeout: float = 600) -> subprocess.CompletedProcess:
        env = {**self._baseline, **(set_env or {})}
        argv = [sys.executable, "-c", code, *map(str, args)]
        if all(_read_after_the_fork(k) for k, v in (set_env or {}).items() if self._baseline.get(k) != v):
            if self._server is None:
                self._server = forkserver.ForkServer(PRELOAD, self._baseline, log=str(self._folder / "server.log"),
                                                     new_session=True)
            try:
                return self._forked(argv, env, cwd, timeout)
            except forkserver.Refused:
                pass
        return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def _forked(self, argv: list[str], env: dict[str, str], cwd, timeout: float) -> subprocess.CompletedProcess:
        self._runs += 1
        output, errors = (self._folder / f"{self._runs}.{name}" for name in ("out", "err"))
        request = {"code": argv[2], "args": argv[3:], "cwd": str(cwd), "env": env, "output": str(output),
                   "errors": str(errors)}
        status = self._server.request(request, timeout)
        out, err = output.read_text(), errors.read_text()
        output.unlink()
        errors.unlink()
        if status is None:
            raise subprocess.TimeoutExpired(argv, timeout, output=out, stderr=err)
        self.forked += 1
        return subprocess.CompletedProcess(argv, status, out, err)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
