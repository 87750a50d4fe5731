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


def test_tests_are_chosen_by_marker_never_by_name():
    """The lanes (scripts/test.sh, its --fast inner loop that the README names, scripts/test_oldest.sh, gpu_check's
    Triton steps) select tests with -m over markers pyproject.toml declares: no --deselect, no -k."""
    declared = re.findall(r'^    "(\w+): ', (ROOT / "pyproject.toml").read_text(), re.M)
    assert {"slow", "subprocess", "distributed", "compile", "oldest", "gpu_versions"} <= set(declared)
    lanes = {path: (ROOT / path).read_text() for path in ("scripts/test.sh", "scripts/test_oldest.sh",
                                                            "hf_moe/gpu_check/steps.py")}
    for path, text in lanes.items():
        assert "--deselect" not in text and " -k " not in text and '"-k"' not in text, path
    expressions = re.findall(r'-m "([^"]+)"', lanes["scripts/test.sh"] + lanes["scripts/test_oldest.sh"])
    from hf_moe.gpu_check import steps

    expressions += [steps.GPU_TESTS, steps.SMOKE_TESTS, steps.MEMCHECK_TESTS]
    for expression in expressions:
        unknown = set(re.findall(r"\w+", expression)) - {"not", "and", "or"} - set(declared)
        assert not unknown, (expression, unknown)
    assert "bash scripts/test.sh --fast" in (ROOT / "README.md").read_text()
    assert '"--fast"' in lanes["scripts/test.sh"]


def test_the_durations_table_is_written_from_a_pytest_log(tmp_path):
    """`bash scripts/test.sh --durations` turns pytest's --durations=0 section into the committed table: each test's
    setup + call + teardown, and each file's sum (what `--dist loadfile` gives one worker), the slowest first."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("test_durations", ROOT / "scripts" / "test_durations.py")
    durations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(durations)
    log = tmp_path / "log"
    log.write_text("=== slowest durations ===\n"
                   "12.50s call     tests/test_a.py::test_x[p-1]\n"
                   "1.00s setup    tests/test_a.py::test_x[p-1]\n"
                   "3.25s call     tests/test_b.py::test_y\n"
                   "0.10s teardown tests/test_a.py::test_z\n"
                   "=== 3 passed in 20.00s ===\n")
    out = tmp_path / "table.txt"
    durations.main(str(log), str(out), "pytest -n 2 --durations=0")
    text = out.read_text()
    assert "# command: pytest -n 2 --durations=0" in text and "# pytest: 3 passed in 20.00s" in text
    by_file = text.split("## by file")[1].split("## by test")[0].splitlines()[2:4]
    assert by_file[0].split() == ["13.6", "2", "tests/test_a.py"] and by_file[1].split() == ["3.2", "1", "tests/test_b.py"]
    first = text.split("## by test")[1].splitlines()[2].split()
    assert first == ["13.50", "1.00", "12.50", "0.00", "tests/test_a.py::test_x[p-1]"]
