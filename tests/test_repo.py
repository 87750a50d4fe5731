"""The README's two commands exist, and CI runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n\s*(.+?)\n\s*```", section)


def test_readme_has_the_two_commands():
    assert _readme_commands() == ["bash examples/quickstart.sh", "bash scripts/test.sh"]
    for command in _readme_commands():
        assert (ROOT / command.split()[1]).is_file(), command


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in [line.strip() for line in ci]


def test_oldest_transformers_is_the_same_everywhere():
    """The bound in pyproject.toml, the version scripts/test_oldest.sh installs, and compat's record agree; so do
    the oldest torch, triton, accelerate and safetensors (the lent GPU's), and torch's lower bound."""
    from hf_moe.compat import TESTED

    oldest, newest = TESTED["transformers"]
    script = (ROOT / "scripts" / "test_oldest.sh").read_text()
    assert f"OLDEST={oldest} " in script
    for name in ("torch", "triton", "accelerate", "safetensors"):
        assert f"{name.upper()}={TESTED[name][0]}" in script, name
    torch_minor = ".".join(TESTED["torch"][0].split(".")[:2])
    assert f'"torch>={torch_minor}"' in (ROOT / "pyproject.toml").read_text()
    major, minor, _ = newest.split(".")
    bound = f'"transformers>={".".join(oldest.split(".")[:2])},<{major}.{int(minor) + 1}"'
    assert bound in (ROOT / "pyproject.toml").read_text()
    assert "bash scripts/test_oldest.sh" in (ROOT / "scripts" / "test.sh").read_text()
