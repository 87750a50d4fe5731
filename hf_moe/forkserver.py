"""Python programs run in children forked from a server that has already imported what they import.

A fresh interpreter spends seconds importing torch and transformers' model code (about 10 s of a 2-core machine)
before it runs anything. A fork server runs those imports once; each program then runs in a child forked from it,
which is what a fresh interpreter would be after the same imports: its own session (killing its process group
kills what it started), working directory, environment, `sys.argv` and `sys.path[0]`, stdin from /dev/null, stdout
and stderr into files, the program run as `__main__`; it ends as the interpreter would end it (non-daemon threads
joined, atexit handlers run, an uncaught exception's traceback on stderr, `sys.exit`'s status), less the teardown of
the modules the server imported.

    server:  python path/to/hf_moe/forkserver.py STATEMENT...
    client:  ForkServer(statements, env).start(request) -> Child, .wait(timeout); or .request(request, timeout)

The server runs the import statements, says {"ready": "ok"} (or why it cannot fork) on stdout, then serves one
JSON request per line on stdin, one at a time: {"script": PATH} (as `python PATH`), {"module": NAME} (`python -m`)
or {"code": SOURCE} (`python -c`), with "args", "output" (the child's stdout, and its stderr unless "errors" is
given), and optionally "cwd" and "env" (else the server's). It answers {"pid": ...} when the child starts and
{"status": ...} when it ends (os.waitstatus_to_exitcode: negative for a signal), or {"refused": why} instead.

Fork copies only the calling thread, so the server forks only while it runs no thread but OpenBLAS's idle pools
(which re-create themselves after a fork): an OpenMP pool (torch's intra-op threads, started by its first large op)
or a Python thread makes it refuse (`why_not_fork`), and the caller runs the program in a fresh interpreter. What must
not come here at all (a program whose environment differs in a variable the imports read) is the caller's rule.

This module imports the standard library only, and its server is started by path, not with `python -m`: a server
that must not hold hf_moe (a test of what importing hf_moe does) does not import the package. Used by
`python -m hf_moe.gpu_check --smoke` and by the test suite (README blocks, fresh processes, distributed ranks).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import types


def _openblas_threads() -> int:
    """Worker threads OpenBLAS's pools may hold here: one pool per OpenBLAS library loaded, each with its thread count
    less the caller (OPENBLAS_NUM_THREADS, else GOTO_NUM_THREADS, else OMP_NUM_THREADS, else the cores)."""
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1].lower()}
    names = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
    wanted = next((os.environ[n] for n in names if os.environ.get(n, "").strip().isdigit()), None)
    per_pool = min(int(wanted), os.cpu_count() or 1) if wanted else (os.cpu_count() or 1)
    return len(libraries) * max(per_pool - 1, 0)


def why_not_fork() -> str | None:
    """None when forking this process is safe now, else why not."""
    if threading.active_count() != 1:
        return f"this process runs {threading.active_count()} Python threads"
    threads, allowed = len(os.listdir("/proc/self/task")), 1 + _openblas_threads()
    if threads > allowed:
        return f"this process runs {threads} threads, more than its main thread and OpenBLAS's pools ({allowed})"
    return None


# ------------------------------------------------------------------------------------------------------------ child
def become(request: dict, closing: tuple = (), streams: tuple[int, int, int] | None = None):
    """In a just-forked child: become the request's process and run it (never returns). `closing`: the server's
    files the child must not hold; `streams`: the child's stdin, stdout and stderr, else /dev/null and the request's
    "output" and "errors" files."""
    os.setsid()
    for end in closing:
        end.close()
    if streams is None:
        null = os.open(os.devnull, os.O_RDONLY)
        output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        errors = os.open(request["errors"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if "errors" in request \
            else output
        streams = (null, output, errors)
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
    for fd in set(streams) - {0, 1, 2}:
        os.close(fd)
    if "cwd" in request:
        os.chdir(request["cwd"])
    if "env" in request:
        os.environ.clear()
        os.environ.update(request["env"])
    os._exit(run_as_main(request))


def run_as_main(request: dict) -> int:
    """Run request["module"] as `python -m MODULE ARGS` would, request["code"] as `python -c CODE ARGS`, or
    request["script"] as `python SCRIPT ARGS` (a console script, too, is such a script), with request.get("args") as
    its arguments, in this forked process; then end it as the interpreter would, less the teardown of the modules
    imported before the fork. Returns the exit status, for `os._exit`."""
    if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator itself; `random` reseeds after fork
        sys.modules["numpy"].random.seed()

    import atexit
    import runpy

    try:
        if "module" in request:
            sys.argv = ["-m", *request.get("args", [])]
            sys.path[0] = os.getcwd()
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        elif "code" in request:
            sys.argv = ["-c", *request.get("args", [])]
            sys.path[0] = ""
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(request["code"], "<string>", "exec"), main.__dict__)
        else:
            script = request["script"]
            sys.argv = [script, *request.get("args", [])]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
    except BaseException:  # as the interpreter reports an uncaught exception
        sys.excepthook(*sys.exc_info())
        status = 1
    # The interpreter's own shutdown, less the teardown of every module imported before the fork (seconds, and
    # nothing a program can observe): non-daemon threads joined, atexit handlers run, the standard streams flushed.
    while others := [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]:
        for thread in others:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return status


def _exit_status(code) -> int:
    """The exit status of `sys.exit(code)`, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# ----------------------------------------------------------------------------------------------------------- server
def preload(statements: list[str]) -> None:
    """Run each import statement; one that fails says so on stderr (it fails again, with its message, in the program
    that has it) and the others still run."""
    for statement in statements:
        try:
            exec(statement, {})
        except Exception as error:
            print(f"forkserver: {statement}: {error!r}", file=sys.stderr)


def serve(listener=None, on_connection=None) -> None:
    """Serve requests on stdin (the module's docstring) until it closes; the imports are done. `listener`: a listening
    socket whose connections go to `on_connection(connection, closing)` between requests (`closing`: the server's
    files a child it forks must close)."""
    # The protocol moves off fds 0 and 1, so nothing a child inherits or prints can reach it.
    reader, writer = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    ours = (reader, writer) if listener is None else (reader, writer, listener)

    def say(message: dict) -> None:
        writer.write(json.dumps(message) + "\n")
        writer.flush()

    say({"ready": why_not_fork() or "ok"})
    waiting = [reader] if listener is None else [reader, listener]
    while True:
        readable, _, _ = select.select(waiting, [], [])
        if listener in readable:
            connection, _ = listener.accept()
            with connection:
                on_connection(connection, ours)
            continue
        line = reader.readline()
        if not line:
            return
        request = json.loads(line)
        why = why_not_fork()
        if why is not None:
            say({"refused": why})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            become(request, ours)
        say({"pid": pid})
        _, status = os.waitpid(pid, 0)
        say({"status": os.waitstatus_to_exitcode(status)})


def main(argv: list[str]) -> None:
    # As `python -m` in the server's working directory: the programs' imports resolve from there, never from hf_moe/.
    sys.path[0] = os.getcwd()
    preload(argv)
    serve()


# ----------------------------------------------------------------------------------------------------------- client
class Refused(RuntimeError):
    """The server cannot run this program (it ended, or forking is not safe now): run it in a fresh interpreter."""


class ForkServer:
    """A fork server with `env` in `cwd` that has run the import `statements`; its children run one at a time. It
    ends with `close()` or when this process dies. `log`: a file for the server's own stderr (default: this
    process's). `argv`: another server's command line (one that calls `serve`). `new_session`: the server leads a
    session of its own (else it is in this process's group, and goes when that group is killed)."""

    def __init__(self, statements: list[str], env: dict[str, str], *, cwd: str | None = None, log: str | None = None,
                 argv: list[str] | None = None, new_session: bool = False):
        self._log = log
        argv = argv or [sys.executable, os.path.abspath(__file__), *statements]
        stderr = open(log, "wb") if log is not None else None
        try:
            self.process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=stderr, start_new_session=new_session)
        finally:
            if stderr is not None:
                stderr.close()
        self._lines, self._ready = b"", None

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ready(self) -> str:
        """"ok", or why the server cannot fork (waits for its imports; read once)."""
        if self._ready is None:
            self._ready = self._answer(None)["ready"]
        return self._ready

    def start(self, request: dict) -> Child:
        """Fork a child that runs `request` (the module's docstring); Refused when the server cannot."""
        if self.ready() != "ok":
            raise Refused(self._ready)
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self._ended() from None
        started = self._answer(None)
        if "refused" in started:
            raise Refused(started["refused"])
        return Child(self, started["pid"])

    def request(self, request: dict, timeout: float) -> int | None:
        """Run `request` in a child: its exit status, or None when it ran past `timeout` seconds (then it is killed
        with its process group). Refused when the server cannot run it."""
        child = self.start(request)
        try:
            return child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return None

    def close(self) -> None:
        """End the server now (between children it holds nothing to save)."""
        self.process.kill()
        self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()

    def _answer(self, timeout: float | None) -> dict:
        """The server's next answer, waiting at most `timeout` seconds (None: for ever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out = self.process.stdout.fileno()
        while b"\n" not in self._lines:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and (wait <= 0 or not select.select([out], [], [], wait)[0]):
                raise subprocess.TimeoutExpired("a fork server's child", timeout)
            chunk = os.read(out, 65536)
            if not chunk:
                raise self._ended()
            self._lines += chunk
        line, self._lines = self._lines.split(b"\n", 1)
        return json.loads(line)

    def _ended(self) -> Refused:
        where = f"; its log: {self._log}" if self._log else " (its traceback is on this process's stderr)"
        return Refused(f"the fork server ended (exit status {self.process.wait()}){where}")


class Child:
    """A child of a ForkServer, waited for as a subprocess.Popen is: `wait()` gives its exit status (negative: the
    signal that ended it) or raises subprocess.TimeoutExpired."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid, self.status = server, pid, None

    def wait(self, timeout: float | None = None) -> int:
        if self.status is None:
            self.status = self.server._answer(timeout)["status"]
        return self.status

    def kill(self) -> None:
        """SIGKILL the child's process group (what it started goes too), or the child itself when it was killed before
        it made its group."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            if self.status is None:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


if __name__ == "__main__":
    main(sys.argv[1:])
