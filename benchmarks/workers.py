"""A benchmark contestant in a process of its own (for its own peak RSS), driven by JSON lines: each command is one
line on the worker's stdin, each answer one line on its stdout after "@@ " (anything else it prints is ignored).
benchmarks/serve_worker.py (Hugging Face models) and benchmarks/llamacpp_bench.mjs (llama.cpp) speak it."""

from __future__ import annotations

import json
import subprocess


class Worker:
    """A contestant's process: JSON commands on its stdin, one JSON answer per command on its stdout after "@@ "."""

    def __init__(self, cmd: list[str], name: str, env: dict | None = None):
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self._answer()

    def _answer(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name}: the worker exited ({self.proc.wait()}) before answering; its "
                                   "stderr is above")
            if line.startswith("@@ "):
                answer = json.loads(line[3:])
                if "error" in answer:
                    raise RuntimeError(f"{self.name}: {answer['error']}")
                return answer

    def call(self, op: str, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
