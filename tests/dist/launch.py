"""`torchrun --standalone` for the tests, with one interpreter for every rank of every launch:

    python tests/dist/launch.py NPROC SCRIPT ARGS... [--then NPROC SCRIPT ARGS...]...

imports torch.distributed, transformers' model code and hf_moe once, then runs the launches in turn. Each forks NPROC
ranks that run SCRIPT as `python SCRIPT ARGS` would (`forkserver.run_as_main`), with the variables torchrun gives
its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; rank 0 hosts the
store), and waits for them. When a rank fails, the others are stopped (SIGTERM, then SIGKILL), as torchrun stops
them, and the launcher exits with the failed rank's status without starting the next launch. NPROC 0 runs SCRIPT once
with none of those variables, as `python SCRIPT ARGS` (no process group). Before each launch the launcher prints a line
`@@launch I` (I counts from 0), so a caller can tell the launches' output apart.

Why: each interpreter of a rank spends most of a launch importing transformers' model code (about 10 s on a 2-core
machine), and torchrun's agent is one more. The expert-parallel fixture's four launches started 12 interpreters (3
agents, 9 ranks); here they start one. What torchrun itself does is tested with torchrun: the launch commands the
expert-parallel error names, `accelerate launch` of the example, generate under expert parallelism (SIGTERM to the
agent) and DeepSpeed's ZeRO-3.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: readme_zygote, and the scripts' conftest
from readme_zygote import forkserver  # noqa: E402

PRELOAD = ("torch.distributed", "transformers.modeling_utils", "hf_moe")
STOP_GRACE_S = 10  # after SIGTERM, before SIGKILL (torchrun waits 30 s; these ranks hold nothing to save)


def launches(argv: list[str]) -> list[tuple[int, str, list[str]]]:
    """[(nproc, script, args)] of the command line, launches separated by `--then`."""
    found, current = [], []
    for word in [*argv, "--then"]:
        if word != "--then":
            current.append(word)
            continue
        if len(current) < 2 or not current[0].isdigit():
            raise SystemExit(f"launch.py: each launch is NPROC SCRIPT ARGS..., got {current!r}")
        found.append((int(current[0]), current[1], current[2:]))
        current = []
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(script: str, args: list[str], rank: int, nproc: int, port: int) -> int:
    why = forkserver.why_not_fork()
    if why is not None:  # a thread (an OpenMP pool) would be lost in the fork, and a rank could hang on its lock
        raise SystemExit(f"launch.py: cannot fork the ranks: {why}")
    pid = os.fork()
    if pid:
        return pid
    if nproc:
        os.environ.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        })
    os._exit(forkserver.run_as_main({"script": script, "args": args}))


def _wait(ranks: dict[int, int]) -> int:
    """Wait for every rank ({pid: rank}); returns 0, or the exit status of the first rank that failed, after
    stopping the others."""
    failed, deadline = 0, None
    while ranks:
        pid, status = os.waitpid(-1, 0 if deadline is None else os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
            time.sleep(0.1)
            continue
        rank = ranks.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if rank is None or code == 0 or failed:
            continue
        failed = code if code > 0 else 128 - code  # (a signal, as a shell reports it)
        print(f"launch.py: rank {rank} exited {code}; stopping the other ranks", file=sys.stderr, flush=True)
        for other in ranks:
            os.kill(other, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
    return failed


def main(argv: list[str]) -> int:
    plan = launches(argv)
    for name in PRELOAD:
        importlib.import_module(name)
    for index, (nproc, script, args) in enumerate(plan):
        print(f"@@launch {index}", flush=True)
        port = _free_port()
        ranks = {_start(script, args, rank, nproc, port): rank for rank in range(max(nproc, 1))}
        failed = _wait(ranks)
        if failed:
            return failed
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
