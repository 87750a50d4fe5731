"""Comments say why, not when: no issue numbers in code, tests, scripts or benchmarks.

An issue number tells a reader where a change came from, which git log already records; the reason belongs in the
comment itself, and measurements belong in docs/ and benchmarks/results/ with their date, machine and commit.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["hf_moe", "csrc", "scripts", "tests", "benchmarks", "examples", "hf_moe_cli.py", "setup.py"]
NOT_SCANNED = [ROOT / "benchmarks" / "results"]  # measurements live there, with the runs they came from
CODE = {".py", ".sh", ".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".js", ".mjs"}
# "issue 29", "Issue #29", "issues 20 and 28", "test_issue_29", "(#29)"
ISSUE_NUMBER = re.compile(r"[Ii]ssues? ?[_#]?[0-9]+|\(#[0-9]+\)")


def code_files(root: Path = ROOT) -> list[Path]:
    """The code files under SCANNED (sorted), but for this file and NOT_SCANNED."""
    found = []
    for name in SCANNED:
        path = root / name
        paths = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
        for file in paths:
            if (file.is_file() and file.suffix in CODE and file.resolve() != Path(__file__).resolve()
                    and not any(file.is_relative_to(root / p.relative_to(ROOT)) for p in NOT_SCANNED)):
                found.append(file)
    return found


def issue_numbers(root: Path = ROOT) -> list[str]:
    """`path:line: text` for each line of a code file that names an issue by number."""
    hits = []
    for file in code_files(root):
        for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
            if ISSUE_NUMBER.search(line):
                hits.append(f"{file.relative_to(root)}:{number}: {line.strip()[:120]}")
    return hits


def test_no_issue_numbers_in_code():
    hits = issue_numbers()
    assert not hits, ("issue numbers in code (say why in the comment instead; a docs/ page may be named):\n"
                      + "\n".join(hits))


def test_the_pattern_finds_the_forms_issue_numbers_take(tmp_path):
    (tmp_path / "hf_moe").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "hf_moe" / "a.py").write_text("x = 1  # (merge, issue 21)\ny = 2  # see Issue #7\nz = 3\n")
    (tmp_path / "hf_moe" / "b.cpp").write_text("// fixed in (#12)\nint issues = 3;  // 3 issues\n")
    (tmp_path / "hf_moe" / "c.py").write_text("def test_issue_29_save():\n    '''issues 20 and 28'''\n")
    (tmp_path / "hf_moe" / "notes.md").write_text("issue 5\n")  # not code
    (tmp_path / "benchmarks" / "results" / "run.py").write_text("# issue 6\n")  # results are not scanned
    hits = issue_numbers(tmp_path)
    assert [h.split(": ")[0] for h in hits] == ["hf_moe/a.py:1", "hf_moe/a.py:2", "hf_moe/b.cpp:1", "hf_moe/c.py:1",
                                                "hf_moe/c.py:2"], hits
