"""A fork server for the README's ```python blocks: one process per test worker imports torch, transformers and hf_moe
once, and each block runs in a child forked from it, as `python SCRIPT` would run it.

Most blocks spend more time starting Python and importing hf_moe than running. The child is what a fresh interpreter
would be after the same imports: its own session (so a timeout kills its whole process group), its own working
directory, environment, `sys.argv` and `sys.path[0]`, stdin from /dev/null, stdout and stderr into one file, the block
run as `__main__`; it ends as the interpreter would end it (non-daemon threads joined, atexit handlers run, an
uncaught exception's traceback on stderr, `sys.exit`'s status), less the teardown of the modules the server imported.

Fork copies only the calling thread. A child is forked only while the server runs no threads but OpenBLAS's idle
pools (which re-create themselves after a fork through pthread_atfork): an OpenMP pool (torch's intra-op threads,
started by the first large op) or any Python thread makes the server refuse, and the caller runs the block in a fresh
interpreter. Which blocks may not come here at all is the caller's rule (`forkable` in test_readme.py).

Run as `python readme_zygote.py STATEMENT...`: runs the import statements (`serve`), says `{"ready": ...}` on stdout,
then serves one JSON request per line on stdin: {"script", "cwd", "env", "output"} -> {"pid": ...} when the child
starts, then {"status": ...} when it ends (os.waitstatus_to_exitcode: negative for a signal), or {"refused": why}
instead of both.
"""

from __future__ import annotations

import ast
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time


# --------------------------------------------------------------------------------------------------------- server
def _openblas_threads() -> int:
    """Worker threads OpenBLAS's pools may hold here: one pool per OpenBLAS library loaded, each with its thread count
    less the caller (OPENBLAS_NUM_THREADS, else GOTO_NUM_THREADS, else OMP_NUM_THREADS, else the cores)."""
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1].lower()}
    names = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
    wanted = next((os.environ[n] for n in names if os.environ.get(n, "").strip().isdigit()), None)
    per_pool = min(int(wanted), os.cpu_count() or 1) if wanted else (os.cpu_count() or 1)
    return len(libraries) * max(per_pool - 1, 0)


def _why_not_fork() -> str | None:
    """None when forking is safe now, else why not."""
    if threading.active_count() != 1:
        return f"the server runs {threading.active_count()} Python threads"
    threads, allowed = len(os.listdir("/proc/self/task")), 1 + _openblas_threads()
    if threads > allowed:
        return f"the server runs {threads} threads, more than its main thread and OpenBLAS's pools ({allowed})"
    return None


def _child(request: dict, channel: tuple) -> None:
    """Become the block's process and run it (never returns)."""
    os.setsid()
    for end in channel:
        end.close()
    null = os.open(os.devnull, os.O_RDONLY)
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(null)
    os.close(output)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["script"]
    sys.argv = [script]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
    if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator itself; `random` reseeds after fork
        sys.modules["numpy"].random.seed()

    import atexit
    import runpy

    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
    except BaseException:  # as the interpreter reports an uncaught exception
        sys.excepthook(*sys.exc_info())
        status = 1
    # The interpreter's own shutdown, less the teardown of every module the server imported (seconds, and nothing a
    # block can observe): non-daemon threads joined, atexit handlers run, the standard streams flushed.
    while others := [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]:
        for thread in others:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _exit_status(code) -> int:
    """The exit status of `sys.exit(code)`, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _root(statement: str) -> str:
    """The top-level package an import statement imports from ("import a.b as c" and "from a.b import c": "a")."""
    node = ast.parse(statement).body[0]
    return (node.names[0].name if isinstance(node, ast.Import) else node.module or "").split(".")[0]


def serve(imports: list[str]) -> None:
    """Runs the first import statement, then each other one whose package the first already imported (it warms
    their lazy attributes and submodules; other libraries, which may start threads of their own, are left to the
    blocks), then serves requests until stdin closes."""
    for k, statement in enumerate(imports):
        if k and _root(statement) not in sys.modules:
            continue
        try:
            exec(statement, {})
        except Exception as error:  # a failing import fails again, with its message, in the block that has it
            print(f"readme_zygote: {statement}: {error!r}", file=sys.stderr)
    # The protocol moves off fds 0 and 1, so nothing a child inherits or prints can reach it.
    reader, writer = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)

    def say(message: dict) -> None:
        writer.write(json.dumps(message) + "\n")
        writer.flush()

    say({"ready": _why_not_fork() or "ok"})
    for line in reader:
        request = json.loads(line)
        why = _why_not_fork()
        if why is not None:
            say({"refused": why})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, (reader, writer))
        say({"pid": pid})
        _, status = os.waitpid(pid, 0)
        say({"status": os.waitstatus_to_exitcode(status)})


# --------------------------------------------------------------------------------------------------------- client
class ZygoteRefused(RuntimeError):
    """The server cannot run this block (it is not running, or forking is not safe now): run it fresh."""


class Zygote:
    """The caller's end: `run(script, cwd, env, output, timeout)` -> exit status, or None on timeout."""

    def __init__(self, imports: list[str], env: dict[str, str], log: str):
        self._log = log
        with open(log, "wb") as err:
            self._process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), *imports], env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, start_new_session=True, bufsize=0,
            )  # unbuffered: select() on the pipe sees every message not yet read
        self._ready: str | None = None

    def _read(self, timeout: float | None) -> dict | None:
        """The next message, or None when `timeout` passes first."""
        out = self._process.stdout
        if timeout is not None and not select.select([out], [], [], max(timeout, 0))[0]:
            return None
        line = out.readline()
        if not line:
            raise ZygoteRefused(f"the server ended (exit status {self._process.wait()}); its log: {self._log}")
        return json.loads(line)

    def ready(self) -> str:
        """"ok", or why the server cannot fork (read once; waits for the imports)."""
        if self._ready is None:
            self._ready = self._read(None)["ready"]
        return self._ready

    def run(self, script: str, cwd: str, env: dict[str, str], output: str, timeout: float) -> int | None:
        if self.ready() != "ok":
            raise ZygoteRefused(self._ready)
        request = {"script": script, "cwd": cwd, "env": env, "output": output}
        self._process.stdin.write((json.dumps(request) + "\n").encode())
        self._process.stdin.flush()
        started = self._read(None)
        if "refused" in started:
            raise ZygoteRefused(started["refused"])
        deadline = time.monotonic() + timeout
        ended = self._read(deadline - time.monotonic())
        if ended is None:
            try:
                os.killpg(started["pid"], signal.SIGKILL)  # the child leads its own session: its children go too
            except ProcessLookupError:
                pass
            self._read(None)
            return None
        return ended["status"]

    def close(self) -> None:
        """Ends the server at once (between runs it holds nothing to save)."""
        self._process.kill()
        self._process.wait()
        self._process.stdin.close()
        self._process.stdout.close()


if __name__ == "__main__":
    serve(sys.argv[1:])
