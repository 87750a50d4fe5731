"""Write the table of test durations from a pytest log run with --durations=0 (`bash scripts/test.sh --durations`).

    python scripts/test_durations.py LOG OUT COMMAND

OUT gets the date, the machine, the commit and the command, then the seconds of each test file (the sum of its tests'
setup, call and teardown: what `--dist loadfile` puts on one worker) and of each test, the slowest first.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")


def parse(log: str) -> dict[str, dict[str, float]]:
    """{test id: {phase: seconds}} from the "slowest durations" section of a pytest log."""
    tests: dict[str, dict[str, float]] = defaultdict(dict)
    section = log.split("slowest durations", 1)[1] if "slowest durations" in log else ""
    for line in section.splitlines():
        found = LINE.match(line)
        if found:
            seconds, phase, test = found.groups()
            tests[test][phase] = float(seconds)
    return tests


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs ({cpu}), load average {load} at the end"


def main(log_path: str, out: str, command: str) -> None:
    log = Path(log_path).read_text()
    tests = parse(log)
    if not tests:
        sys.exit(f"test_durations: no 'slowest durations' section in {log_path}: was pytest run with --durations=0?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    closing = [line.strip("= ") for line in log.splitlines() if line.startswith("=") and " in " in line]
    total = {test: sum(phases.values()) for test, phases in tests.items()}
    files: dict[str, list[float]] = defaultdict(list)
    for test, seconds in total.items():
        files[test.split("::")[0]].append(seconds)
    lines = [
        "# Test durations of the whole suite, written by `bash scripts/test.sh --durations`",
        f"# date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit: {commit or 'unknown'}",
        f"# machine: {machine()}",
        f"# command: {command}",
        f"# pytest: {closing[-1] if closing else 'no closing line'}",
        "# seconds: setup + call + teardown, on the worker that ran the test (workers run side by side)",
        "",
        f"## by file ({len(files)} files, {sum(total.values()):.0f} s in all)",
        f"{'seconds':>8} {'tests':>5}  file",
        *(f"{sum(times):8.1f} {len(times):5d}  {name}"
          for name, times in sorted(files.items(), key=lambda item: -sum(item[1]))),
        "",
        f"## by test ({len(tests)} tests)",
        f"{'seconds':>8} {'setup':>7} {'call':>7} {'teardown':>8}  test",
        *(f"{total[test]:8.2f} {tests[test].get('setup', 0):7.2f} {tests[test].get('call', 0):7.2f} "
          f"{tests[test].get('teardown', 0):8.2f}  {test}" for test in sorted(tests, key=lambda t: -total[t])),
    ]
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"test_durations: wrote {out} ({len(tests)} tests)")


if __name__ == "__main__":
    main(*sys.argv[1:4])
