"""What `python -m hf_moe.gpu_check` found, step by step: report.md (for people) and results.json (for tools), both
rewritten after every step, so a run cut short still leaves what it did."""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass
class Step:
    """One step's outcome. `detail` is markdown; `data` is what results.json keeps of it."""

    number: int
    name: str
    status: str = FAILED
    summary: str = ""
    detail: str = ""
    seconds: float = 0.0
    data: dict = field(default_factory=dict)


class Report:
    """The steps run so far, written to `out` (report.md, results.json) after each."""

    def __init__(self, out: Path, title: str, context: dict):
        self.out, self.title, self.context = Path(out), title, context
        self.steps: list[Step] = []
        self.out.mkdir(parents=True, exist_ok=True)

    def run(self, number: int, name: str, fn, *args) -> Step:
        """Run `fn(step, *args)`, which fills in the step (status, summary, detail, data); an exception fails it."""
        step = Step(number, name)
        start = time.perf_counter()
        print(f"[gpu_check] step {number}: {name} ...", flush=True)
        try:
            fn(step, *args)
        except Exception as err:  # a step's failure is a result: record it and go on to the next step
            step.status, step.summary = FAILED, f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}" \
                if str(err).strip() else type(err).__name__
            step.detail += f"\n\n```text\n{traceback.format_exc()[-6000:]}\n```\n"
        step.seconds = time.perf_counter() - start
        self.steps.append(step)
        print(f"[gpu_check] step {number}: {step.status} ({step.seconds:.0f} s): {step.summary}", flush=True)
        self.write()
        return step

    @property
    def passed(self) -> bool:
        return all(s.status != FAILED for s in self.steps)

    def write(self) -> None:
        results = dict(title=self.title, **self.context, passed=self.passed, steps=[asdict(s) for s in self.steps])
        (self.out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        lines = [f"# {self.title}", ""]
        lines += [f"- {key}: {value}" for key, value in self.context.items()]
        lines += ["", "| step | status | seconds | summary |", "| --- | --- | --- | --- |"]
        lines += [f"| {s.number}. {s.name} | {s.status} | {s.seconds:.0f} | {s.summary.replace('|', '/')} |"
                  for s in self.steps]
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
