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

Run as `python readme_zygote.py [--commands DIR] STATEMENT...`: runs the import statements (`serve`), says
`{"ready": ...}` on stdout, then serves one JSON request per line on stdin: {"script" (or "module", or "code" as
`python -c` runs it), "args", "cwd", "env", "output", and "errors" for stderr apart from stdout} -> {"pid": ...}
when the child starts, then {"status": ...} when it ends (os.waitstatus_to_exitcode: negative for a signal), or
{"refused": why} instead of both. tests/fresh_python.py and tests/dist/launch.py use the same child.

The ```bash blocks' commands come here too. With `--commands DIR`, DIR holds stand-ins for `hf-moe` and `python`
(`Zygote.command_env` puts it first on PATH) and the server's socket. A stand-in sends its argv, cwd, environment and
its stdin, stdout and stderr themselves (SCM_RIGHTS) to the server, which forks a child that runs the command as the
real program would (`hf-moe ...` as its console script, `python -m MODULE ...`, `python SCRIPT ...`) on those
streams; the stand-in exits with the child's status, and the child is killed if the stand-in dies first (a block's
timeout kills its process group). Anything else, or an environment that differs from the server's (a variable read
at import may differ), or a script that must run fresh (`needs_fresh`), the stand-in runs with the real program.
"""

from __future__ import annotations

import ast
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types

# What a script does before its own imports cannot reach modules the server imported before it: a script that sets
# the environment (read at import: threads, offline switches, logging) runs fresh, and so does one that starts
# processes that rendezvous with or re-import their parent (multiprocessing, torch.distributed).
_NEEDS_FRESH = re.compile(r"\bos\.(environ|putenv|unsetenv)\b|\bmultiprocessing\b|\btorch\.distributed\b|\bos\.fork\b")
# What bash changes in the environment of the commands it runs, and what only the stand-ins read.
_SHELL_VARIABLES = {"PWD", "OLDPWD", "SHLVL", "_"}
SERVER_VARIABLE = "HF_MOE_README_SERVER"
COMMANDS = ("hf-moe", "python")


def needs_fresh(code: str) -> bool:
    """Whether a script with this source must run in a fresh interpreter rather than in a forked child."""
    return bool(_NEEDS_FRESH.search(code))


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


def why_not_fork() -> str | None:
    """None when forking is safe now, else why not."""
    if threading.active_count() != 1:
        return f"this process runs {threading.active_count()} Python threads"
    threads, allowed = len(os.listdir("/proc/self/task")), 1 + _openblas_threads()
    if threads > allowed:
        return f"this process runs {threads} threads, more than its main thread and OpenBLAS's pools ({allowed})"
    return None


def _child(request: dict, closing: tuple, streams: tuple[int, int, int] | None = None) -> None:
    """Become the request's process and run it (never returns). `streams`: the stand-in's stdin, stdout and stderr;
    without them stdin is /dev/null and stdout and stderr go to request["output"]."""
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
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({k: v for k, v in request["env"].items() if k != SERVER_VARIABLE})  # what it starts runs real
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
    # nothing a script can observe): non-daemon threads joined, atexit handlers run, the standard streams flushed.
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


def _root(statement: str) -> str:
    """The top-level package an import statement imports from ("import a.b as c" and "from a.b import c": "a")."""
    node = ast.parse(statement).body[0]
    return (node.names[0].name if isinstance(node, ast.Import) else node.module or "").split(".")[0]


def _differences(env: dict[str, str], baseline: dict[str, str], commands: str) -> list[str]:
    """The variables a command's environment sets otherwise than the server's was at its start, less bash's own and
    the stand-ins' (their folder on PATH, the server's address)."""
    env, baseline = dict(env), dict(baseline)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != commands)
    ignored = _SHELL_VARIABLES | {SERVER_VARIABLE}
    return sorted(k for k in env.keys() | baseline.keys() if k not in ignored and env.get(k) != baseline.get(k))


def _recv_request(connection: socket.socket) -> tuple[dict, list[int]]:
    """A stand-in's request (one JSON line) and the streams sent with it."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    while not data.endswith(b"\n"):
        more = connection.recv(1 << 16)
        if not more:
            break
        data += more
    return json.loads(data), fds


def _why_fresh(request: dict) -> str | None:
    """Why the script or module a command runs must run in a fresh interpreter, or None. A module is looked up only
    under a package the server has imported (looking it up imports its parents)."""
    if "module" in request:
        parent = request["module"].rpartition(".")[0]
        if parent and parent not in sys.modules:
            return f"{parent} is not imported here"
        import importlib.util

        try:
            spec = importlib.util.find_spec(request["module"])
        except (ImportError, ValueError) as error:
            return repr(error)
        path = spec.origin if spec is not None and spec.submodule_search_locations is None else None
        if path is None or not os.path.isfile(path):
            return f"no source file for {request['module']}"  # a package's __main__, a built-in: left to python
    else:
        path = os.path.join(request["cwd"], request["script"])
    try:
        with open(path, encoding="utf-8") as file:
            return "it must run fresh (needs_fresh)" if needs_fresh(file.read()) else None
    except (OSError, UnicodeDecodeError) as error:
        return repr(error)


def _serve_command(connection: socket.socket, baseline: dict[str, str], commands: str, closing: tuple) -> None:
    """Runs one stand-in's command in a forked child; kills the child if the stand-in goes first."""
    request, fds = _recv_request(connection)
    differ = _differences(request["env"], baseline, commands)
    why = (why_not_fork() or (f"its environment sets {', '.join(differ)} otherwise" if differ else None)
           or _why_fresh(request))
    if why is not None or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        connection.sendall((json.dumps({"refused": why or "no streams came"}) + "\n").encode())
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(request, (*closing, connection), tuple(fds))
    for fd in fds:  # else a reader of the command's pipe would never see it end
        os.close(fd)
    ended = os.pidfd_open(pid)
    try:
        readable, _, _ = select.select([connection, ended], [], [])
        if ended not in readable:  # the stand-in went first (killed with its block): its command goes too
            os.killpg(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(ended)
    try:
        connection.sendall((json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    except OSError:
        pass


def serve(imports: list[str], commands: str | None = None) -> None:
    """Runs the first import statement, then each other one whose package the first already imported (it warms
    their lazy attributes and submodules; other libraries, which may start threads of their own, are left to the
    blocks), then serves requests (stdin, and stand-ins in the folder `commands`) until stdin closes."""
    baseline = dict(os.environ)  # what the imports read
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
    listener = None
    if commands is not None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.path.join(commands, "server.sock"))
        listener.listen(8)
    ours = (reader, writer) if listener is None else (reader, writer, listener)  # what a child closes first

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
                _serve_command(connection, baseline, commands, ours)
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
            _child(request, ours)
        say({"pid": pid})
        _, status = os.waitpid(pid, 0)
        say({"status": os.waitstatus_to_exitcode(status)})


# --------------------------------------------------------------------------------------------------------- client
class ZygoteRefused(RuntimeError):
    """The server cannot run this block (it is not running, or forking is not safe now): run it fresh."""


class Zygote:
    """The caller's end: `run(script, cwd, env, output, timeout)` -> exit status, or None on timeout."""

    def __init__(self, imports: list[str], env: dict[str, str], log: str, commands: str | None = None):
        """`commands`: an empty folder for the stand-ins of `hf-moe` and `python` and the server's socket (see
        `command_env`); none by default."""
        self._log = log
        self.commands = commands
        options = []
        if commands is not None:
            options = ["--commands", commands]
            for name, real in _real_commands(env).items():
                path = os.path.join(commands, name)
                with open(path, "w") as file:  # -I -S: the stand-in needs the standard library alone
                    file.write(f"#!{sys.executable} -IS\nimport sys\n"
                               f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
                               f"from readme_zygote import stand_in\nstand_in({name!r}, {real!r})\n")
                os.chmod(path, 0o755)
        with open(log, "wb") as err:
            self._process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), *options, *imports], env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, start_new_session=True, bufsize=0,
            )  # unbuffered: select() on the pipe sees every message not yet read
        self._ready: str | None = None

    def command_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` for a ```bash block whose `hf-moe` and `python` commands this server runs (the stand-ins first on
        PATH). The stand-ins wait for the server's imports."""
        if self.commands is None or self.ready() != "ok":
            return env
        return {**env, "PATH": os.pathsep.join([self.commands, env.get("PATH", "")]),
                SERVER_VARIABLE: os.path.join(self.commands, "server.sock")}

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
        return self.request({"script": script, "cwd": cwd, "env": env, "output": output}, timeout)

    def request(self, request: dict, timeout: float) -> int | None:
        """Run a request ({"script" | "module" | "code", "args", "cwd", "env", "output", "errors"}: see `_child`
        and `run_as_main`); its exit status, or None on timeout (the child killed)."""
        if self.ready() != "ok":
            raise ZygoteRefused(self._ready)
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


def _real_commands(env: dict[str, str]) -> dict[str, str]:
    """The programs the stand-ins replace, as bash would find them on `env`'s PATH: {name: path}."""
    import shutil

    found = {name: shutil.which(name, path=env.get("PATH")) for name in COMMANDS}
    return {name: path for name, path in found.items() if path is not None}


def _request(name: str, real: str, args: list[str]) -> dict | None:
    """What the server runs for `name ARGS`, or None for a form it does not take (`python -c`, `python -`, options)."""
    if name == "hf-moe":
        return {"script": real, "args": args}
    if len(args) >= 2 and args[0] == "-m":
        return {"module": args[1], "args": args[2:]}
    if args and not args[0].startswith("-") and os.path.isfile(args[0]):
        return {"script": args[0], "args": args[1:]}
    return None


def stand_in(name: str, real: str) -> None:
    """The stand-in for the command `name` (`real` the program): runs `name ARGS` in a child of the server when it
    can, else execs `real` (never returns)."""
    args = sys.argv[1:]
    request = _request(name, real, args)
    address = os.environ.get(SERVER_VARIABLE)
    if request is not None and address:
        request.update(cwd=os.getcwd(), env=dict(os.environ))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.connect(address)
            socket.send_fds(server, [(json.dumps(request) + "\n").encode()], [0, 1, 2])
            reply = server.makefile("rb").readline()
        if not reply:
            sys.exit(f"{name}: the README test's fork server ended while it ran `{name} {' '.join(args)}`")
        reply = json.loads(reply)
        if "status" in reply:
            status = reply["status"]
            os._exit(status if status >= 0 else 128 - status)  # a signal's death, as bash reports it
    os.execv(real, [real, *args])  # a path in argv[0]: `python` found by name would find the stand-in first


if __name__ == "__main__":
    if sys.argv[1:2] == ["--commands"]:
        serve(sys.argv[3:], commands=sys.argv[2])
    else:
        serve(sys.argv[1:])
