"""The walk of `convert_to_moe` (scripts/conversion_walk.py: the hf_moe functions that make a piece of the finished
model, counted in a fresh process) does not grow: a new stop is indirection to remove, or to justify by lowering
nothing else. docs/architecture.md, "The path of a conversion", reads the walk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MOST_STOPS = 19  # the walk in docs/architecture.md


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_conversion_walk_does_not_grow():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "conversion_walk.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    *stops, total = done.stdout.strip().splitlines()
    assert total.startswith(f"{len(stops)} stops in ")
    assert stops[0] == "hf_moe.convert.api.convert_to_moe" and all(s.startswith("hf_moe.") for s in stops)
    assert len(stops) <= MOST_STOPS, "\n".join(stops)
