"""What `python -m hf_moe.gpu_check` found, step by step: report.md (for people) and results.json (for tools), both
rewritten after every step, so a run cut short still leaves what it did.

A step runs in a child process (runner.py) and writes its `Step` to a JSON file of its own as it goes
(`Step.flush`), so that what a step measured before it crashed or ran out of time is kept too.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

PASSED, FAILED, SKIPPED, RUNNING = "passed", "failed", "skipped", "running"


def triton_fallbacks() -> dict[str, str]:
    """{op: error} of the Triton ops that fell back to torch in this process (hf_moe/ops/triton/ops.py's record;
    empty when no Triton op was ever called, so triton is not imported to ask)."""
    ops = sys.modules.get("hf_moe.ops.triton.ops")
    return dict(ops.fell_back) if ops is not None else {}


@dataclass
class Step:
    """One step's outcome. `detail` is markdown; `data` is what results.json keeps of it; `fell_back` names the Triton
    ops that ran torch instead in the step ({op: error}: the step then fails)."""

    number: int
    name: str
    status: str = FAILED
    summary: str = ""
    detail: str = ""
    seconds: float = 0.0
    limit: float = 0.0
    data: dict = field(default_factory=dict)
    fell_back: dict = field(default_factory=dict)
    path: Path | None = field(default=None, repr=False, compare=False)  # where `flush` writes (a child's result)

    def flush(self) -> None:
        """Write the step as it stands to `path` (atomically), with the Triton fallbacks of this process so far."""
        self.fell_back.update(triton_fallbacks())
        if self.path is None:
            return
        staged = self.path.with_suffix(".tmp")
        staged.write_text(json.dumps(self.to_dict(), default=str))
        os.replace(staged, self.path)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "path"}

    @classmethod
    def load(cls, path: Path) -> "Step":
        known = {f.name for f in fields(cls)} - {"path"}
        return cls(**{k: v for k, v in json.loads(path.read_text()).items() if k in known})


class Report:
    """The steps run so far, written to `out` (report.md, results.json) after each."""

    def __init__(self, out: Path, title: str, context: dict):
        self.out, self.title, self.context = Path(out), title, context
        self.steps: list[Step] = []
        self.out.mkdir(parents=True, exist_ok=True)

    def add(self, step: Step) -> None:
        self.steps.append(step)
        self.write()

    @property
    def passed(self) -> bool:
        return bool(self.steps) and all(s.status != FAILED for s in self.steps)

    def fallbacks(self) -> list[tuple[Step, str, str]]:
        """(step, op, error) of every Triton op that fell back to torch, in any step."""
        return [(s, op, err) for s in self.steps for op, err in s.fell_back.items()]

    def failed(self) -> list[str]:
        """"N. name" of every step that failed."""
        return [f"{s.number}. {s.name}" for s in self.steps if s.status == FAILED]

    def conclude(self, tag: str) -> int:
        """Prints each fallback and the verdict, prefixed `[tag]`; returns the exit code (0 passed, 1 failed)."""
        for step, op, err in self.fallbacks():
            print(f"[{tag}] Triton op {op} fell back to torch in step {step.number} ({step.name}): {err}", flush=True)
        print(f"[{tag}] {'passed' if self.passed else 'FAILED: ' + ', '.join(self.failed())}; see "
              f"{self.out / 'report.md'}", flush=True)
        return 0 if self.passed else 1

    def write(self) -> None:
        results = dict(title=self.title, **self.context, passed=self.passed, written=time.strftime("%H:%M:%S"),
                       steps=[s.to_dict() for s in self.steps])
        (self.out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        lines = [f"# {self.title}", ""]
        lines += [f"- {key}: {value}" for key, value in self.context.items()]
        lines += [f"- verdict: {'passed' if self.passed else 'FAILED'}" + ("" if self.passed else
                  f" ({', '.join(self.failed())})")]
        lines += ["", "| step | status | seconds (limit) | summary |", "| --- | --- | --- | --- |"]
        lines += [f"| {s.number}. {s.name} | {s.status} | {s.seconds:.0f} ({s.limit:.0f}) | "
                  f"{s.summary.replace('|', '/')} |" for s in self.steps]
        fallbacks = self.fallbacks()
        if fallbacks:
            lines += ["", "## Triton ops that fell back to torch (the run fails: torch ran where Triton was measured)",
                      ""]
            lines += [f"- step {s.number} ({s.name}): `{op}`: {err}" for s, op, err in fallbacks]
        for s in self.steps:
            lines += ["", f"## {s.number}. {s.name}: {s.status}", "", s.summary, "", s.detail.strip()]
        (self.out / "report.md").write_text("\n".join(lines).rstrip() + "\n")


def code_block(text: str, limit: int = 8000) -> str:
    text = text.strip()
    if len(text) > limit:
        text = f"... ({len(text) - limit} characters cut)\n" + text[-limit:]
    return f"```text\n{text}\n```"


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
