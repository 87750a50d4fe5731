"""The fork server of the README's blocks (hf_moe/forkserver.py, with what only the README needs): one server per test
worker imports torch, transformers and hf_moe once, and each ```python block runs in a child forked from it, as
`python SCRIPT` would run it. Which blocks may not come here at all is the caller's rule (`forkable` in
test_readme.py).

The ```bash blocks' commands come here too. With `--commands DIR`, DIR holds stand-ins for `hf-moe` and `python`
(`Zygote.command_env` puts it first on PATH) and the server's socket. A stand-in sends its argv, cwd, environment and
its stdin, stdout and stderr themselves (SCM_RIGHTS) to the server, which forks a child that runs the command as the
real program would (`hf-moe ...` as its console script, `python -m MODULE ...`, `python SCRIPT ...`) on those
streams; the stand-in exits with the child's status, and the child is killed if the stand-in dies first (a block's
timeout kills its process group). Anything else, or an environment that differs from the server's (a variable read
at import may differ), or a script that must run fresh (`needs_fresh`), the stand-in runs with the real program.

Run as `python readme_zygote.py [--commands DIR] STATEMENT...`: runs the first import statement, then each other one
whose package the first already imported (it warms their lazy attributes and submodules; other libraries, which may
start threads of their own, are left to the blocks), then serves as hf_moe/forkserver.py does. tests/fresh_python.py
and tests/dist/launch.py use the same module (`forkserver` here), which is loaded by path: it imports the standard
library only, and a server of fresh_python must not import hf_moe.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import select
import signal
import socket
import sys
from pathlib import Path


def _load_forkserver():
    """hf_moe/forkserver.py as a module of its own (`import hf_moe.forkserver` would import the package first)."""
    spec = importlib.util.spec_from_file_location(
        "hf_moe_forkserver", Path(__file__).resolve().parents[1] / "hf_moe" / "forkserver.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


forkserver = sys.modules.get("hf_moe_forkserver") or _load_forkserver()
Refused = forkserver.Refused

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
    why = (forkserver.why_not_fork() or (f"its environment sets {', '.join(differ)} otherwise" if differ else None)
           or _why_fresh(request))
    if why is not None or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        connection.sendall((json.dumps({"refused": why or "no streams came"}) + "\n").encode())
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # what the command starts runs the real programs
        request["env"] = {k: v for k, v in request["env"].items() if k != SERVER_VARIABLE}
        forkserver.become(request, (*closing, connection), tuple(fds))
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
    """Runs the first import statement, then each other one whose package the first already imported, then serves
    requests (stdin, and the stand-ins in the folder `commands`) until stdin closes."""
    baseline = dict(os.environ)  # what the imports read
    forkserver.preload(imports[:1])
    forkserver.preload([statement for statement in imports[1:] if _root(statement) in sys.modules])
    if commands is None:
        return forkserver.serve()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(commands, "server.sock"))
    listener.listen(8)
    forkserver.serve(listener, lambda connection, closing: _serve_command(connection, baseline, commands, closing))


# --------------------------------------------------------------------------------------------------------- client
class Zygote(forkserver.ForkServer):
    """The caller's end: a ForkServer that has run `imports` as `serve` runs them; `run(script, cwd, env, output,
    timeout)` -> exit status, or None on timeout."""

    def __init__(self, imports: list[str], env: dict[str, str], log: str, commands: str | None = None):
        """`commands`: an empty folder for the stand-ins of `hf-moe` and `python` and the server's socket (see
        `command_env`); none by default."""
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
        super().__init__(imports, env, log=log, argv=[sys.executable, os.path.abspath(__file__), *options, *imports],
                         new_session=True)

    def command_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` for a ```bash block whose `hf-moe` and `python` commands this server runs (the stand-ins first on
        PATH). The stand-ins wait for the server's imports."""
        if self.commands is None or self.ready() != "ok":
            return env
        return {**env, "PATH": os.pathsep.join([self.commands, env.get("PATH", "")]),
                SERVER_VARIABLE: os.path.join(self.commands, "server.sock")}

    def run(self, script: str, cwd: str, env: dict[str, str], output: str, timeout: float) -> int | None:
        return self.request({"script": script, "cwd": cwd, "env": env, "output": output}, timeout)


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
