"""The child process of one gpu_check step: `python -m hf_moe.gpu_check.child MODULE:FUNCTION RESULT ...`.

It imports the step's function and runs it as fn(step, smoke, limit), flushing the Step to RESULT as it goes; an
exception is the step's failure, recorded with its traceback; a Triton op that fell back to torch fails the step.
The parent (runner.py) kills it at its deadline. (A module of its own: `python -m` of a module that the package's
__init__ imports runs it twice.) Under --smoke it runs in a child of a fork server (hf_moe/forkserver.py), as
`python -m` would run it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

from .record import FAILED, RUNNING, Step, code_block


def child_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_moe.gpu_check.child",
                                     description="Run one gpu_check step (started by python -m hf_moe.gpu_check).")
    parser.add_argument("target", help="module:function, called as function(step, smoke, limit)")
    parser.add_argument("result", type=Path, help="where the step's JSON goes (rewritten as it goes)")
    parser.add_argument("--number", type=int, default=0)
    parser.add_argument("--name", default="step")
    parser.add_argument("--limit", type=float, default=600.0, help="seconds the parent allows this step")
    parser.add_argument("--deadline", type=float, default=None,
                        help="time.time() at which the parent kills this step: the step gets what is left of its "
                             "limit after this process's start (importing torch can take 20 s on a cold machine)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    step = Step(args.number, args.name, RUNNING, limit=args.limit, path=args.result)
    step.flush()
    start = time.monotonic()
    try:
        module, function = args.target.split(":")
        fn = getattr(importlib.import_module(module), function)
        fn(step, args.smoke, args.limit if args.deadline is None else min(args.limit, args.deadline - time.time()))
    except Exception as err:  # a step's failure is a result: recorded, and the parent goes on to the next step
        message = str(err).strip()
        step.status = FAILED
        step.summary = f"{type(err).__name__}: {message.splitlines()[0][:300]}" if message else type(err).__name__
        step.detail += f"\n\n{code_block(traceback.format_exc(), 6000)}\n"
    step.seconds = time.monotonic() - start
    step.flush()
    if step.fell_back:
        ops = "; ".join(f"{op} ({err})" for op, err in step.fell_back.items())
        step.status = FAILED
        step.summary = f"Triton fell back to torch: {ops}; " + step.summary
        step.flush()
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
