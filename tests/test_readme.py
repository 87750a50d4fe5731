"""Every code block of README.md and of the pages in docs/ runs as written.

Fenced blocks tagged ```python or ```bash are executed, one test each (ids `L<line>-<lang>`, the line of the
opening fence); ```text and untagged blocks (output, file trees) never are. A block is skipped only when an HTML
comment right before its fence (blank lines between allowed) says why, and the reason shows in `pytest -rs`:

    <!-- readme-test: skip: needs a GPU -->
    ```bash
    ...

Each executed block runs in a fresh working directory holding the fixtures the README refers to by name:

    dense-model/   a tiny random Llama (3 layers, hidden 64, vocab 128) with a character-level tokenizer that has
                   a chat template (`role: content</s>` lines; the generation prompt is `assistant: `)
    moe-model/     dense-model after `hf-moe convert dense-model moe-model --num-experts 4 --top-k 2` (tokenizer
                   copied)
    data.jsonl     32 chat examples: {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}
    text.jsonl     32 lines of plain English: {"text": ...}
    text.txt       the same 32 lines as plain text
    examples/  benchmarks/   copies of the repository's folders, so `python examples/x.py` works as written

Python blocks run as a script with this interpreter, bash blocks with `bash -euo pipefail -c`, with `python` and
`hf-moe` of this environment first on PATH, the repository on PYTHONPATH, and the hub offline. A python block runs
in a process forked from a server that has already imported hf_moe (tests/readme_zygote.py: the same script, cwd,
environment and exit status, without the seconds of imports), unless `forkable` says it needs a fresh interpreter
or the server cannot fork safely. A bash block's `hf-moe ...`, `python -m MODULE ...` and `python SCRIPT ...`
commands run there too, through stand-ins first on its PATH (tests/readme_zygote.py says when they do not);
HF_MOE_README_FRESH=1 runs every block and command fresh. HF_MOE_README=FILE runs another
markdown file instead of README.md and docs/ (to test this harness).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import tiny_dense, tiny_tokenizer
from readme_zygote import Refused, Zygote, needs_fresh

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCUMENTS = (
    [Path(os.environ["HF_MOE_README"]).resolve()] if os.environ.get("HF_MOE_README")
    else [README, *sorted((REPO / "docs").glob("*.md"))]
)
README_MAX_LINES = 300
RUN_LANGUAGES = ("python", "bash")
LANGUAGES = RUN_LANGUAGES + ("text", "")
TIMEOUT_S = 600
TAIL_LINES = 60
# Copied (not linked) into each block's directory, so a block that writes beside a script leaves the checkout alone.
REPO_FOLDERS = ("examples", "benchmarks")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


# --------------------------------------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str  # the first word of the info string, lower-cased ("" when untagged)
    code: str
    skip: str | None = None  # the reason of an attached `readme-test: skip` comment

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.lang or 'untagged'}"


_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_DIRECTIVE = re.compile(r"^<!--\s*readme-test:\s*(?P<body>.*?)\s*-->$", re.DOTALL)
_SKIP = re.compile(r"^skip\s*:\s*(?P<reason>.*)$", re.DOTALL)


def _dedent(line: str, indent: int) -> str:
    """`line` less up to `indent` leading spaces (a fence inside a list item is indented, and so is its code)."""
    strip = len(line) - len(line.lstrip(" "))
    return line[min(strip, indent):]


def parse_blocks(markdown: str) -> tuple[list[Block], list[str]]:
    """The fenced code blocks of `markdown`, and what is wrong with its use of them (each problem names its line)."""
    lines = markdown.splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    pending: tuple[int, str] | None = None  # (line, reason) of a skip comment waiting for its fence
    i = 0
    while i < len(lines):
        number, line = i + 1, lines[i]
        stripped = line.strip()
        fence = _FENCE.match(line)
        if fence and not (fence["fence"][0] == "`" and "`" in fence["info"]):
            indent, marker = len(fence["indent"].expandtabs(4)), fence["fence"]
            info = fence["info"].strip()
            lang = info.split()[0].lower() if info else ""
            body, i = [], i + 1
            while i < len(lines):
                close = _FENCE.match(lines[i])
                if (close and close["fence"][0] == marker[0] and len(close["fence"]) >= len(marker)
                        and not close["info"].strip()):
                    break
                body.append(_dedent(lines[i], indent))
                i += 1
            else:
                problems.append(f"line {number}: the ```{lang} block is never closed")
            i += 1
            skip = None
            if pending is not None:
                if lang in RUN_LANGUAGES:
                    skip = pending[1]
                else:
                    problems.append(
                        f"line {pending[0]}: a readme-test skip comment is attached to a ```{lang} block at line "
                        f"{number}, which never runs; remove the comment"
                    )
                pending = None
            if lang not in LANGUAGES:
                problems.append(
                    f"line {number}: unknown fence language {lang!r}; use one of python, bash (run), text or none "
                    f"(not run)"
                )
            code = "\n".join(body) + ("\n" if body else "")
            if lang == "bash":
                problems += [f"line {number + 1 + k}: {p}" for k, p in _prompt_lines(code, "$ ")]
            if lang == "python":
                problems += [f"line {number + 1 + k}: {p}" for k, p in _prompt_lines(code, ">>> ")]
            blocks.append(Block(number, lang, code, skip))
            continue
        if stripped.startswith("<!--") and "readme-test" in stripped:
            start, comment = number, stripped
            while "-->" not in comment and i + 1 < len(lines):  # a comment may span lines
                i += 1
                comment += " " + lines[i].strip()
            if pending is not None:
                problems.append(f"line {pending[0]}: dangling readme-test comment (another one follows it)")
                pending = None
            directive = _DIRECTIVE.match(comment)
            skip = _SKIP.match(directive["body"]) if directive else None
            if skip is None:
                problems.append(
                    f"line {start}: malformed readme-test comment {comment!r}; the only form is "
                    "`<!-- readme-test: skip: REASON -->` right before a ```python or ```bash fence"
                )
            elif not skip["reason"].strip():
                problems.append(f"line {start}: readme-test skip comment without a reason")
            else:
                pending = (start, " ".join(skip["reason"].split()))
        elif stripped and pending is not None:
            problems.append(
                f"line {pending[0]}: dangling readme-test comment: line {number} comes between it and the next fence"
            )
            pending = None
        i += 1
    if pending is not None:
        problems.append(f"line {pending[0]}: dangling readme-test comment at the end of the file (no block follows)")
    return blocks, problems


def _prompt_lines(code: str, prompt: str) -> list[tuple[int, str]]:
    """(0-based line, problem) for each line of `code` that starts with an interactive prompt."""
    return [
        (k, f"a line starts with the prompt {prompt.strip()!r}: put sessions with output in a ```text block, and "
            f"only the commands in a runnable block")
        for k, line in enumerate(code.splitlines()) if line.lstrip().startswith(prompt)
    ]


def _name(document: Path) -> str:
    return str(document.relative_to(REPO)) if document.is_relative_to(REPO) else document.name


def _blocks(document: Path) -> tuple[list[Block], list[str]]:
    return parse_blocks(document.read_text(encoding="utf-8"))


def _params():
    params = []
    for document in DOCUMENTS:
        for block in _blocks(document)[0]:
            if block.lang not in RUN_LANGUAGES:
                continue
            marks = [pytest.mark.slow]
            if block.skip is not None:
                marks = [pytest.mark.skip(reason=f"{_name(document)} line {block.line}: {block.skip}")]
            params.append(pytest.param(document, block, marks=marks, id=f"{_name(document)}:{block.id}"))
    return params


# --------------------------------------------------------------------------------------------------------- fixtures
_CHAT = [
    ("the sky", "The sky is blue on a clear day."),
    ("the sea", "The sea is salty and very deep."),
    ("cats", "Cats sleep for most of the day."),
    ("dogs", "Dogs like to run and play outside."),
    ("the sun", "The sun is a star at the centre of our solar system."),
    ("the moon", "The moon goes around the earth once a month."),
    ("trees", "Trees make the air clean and give us shade."),
    ("rivers", "Rivers carry fresh water down to the sea."),
    ("bread", "Bread is made from flour, water and yeast."),
    ("rain", "Rain falls when clouds get heavy with water."),
    ("bees", "Bees make honey from the nectar of flowers."),
    ("snow", "Snow is frozen water that falls in cold weather."),
    ("books", "Books hold stories and facts for us to read."),
    ("music", "Music is sound put together in a pleasing way."),
    ("mountains", "Mountains are tall and often have snow on top."),
    ("apples", "Apples grow on trees and taste sweet or sour."),
]
_QUESTIONS = ("Tell me about {}.", "What do you know about {}?")


def _write_data(root: Path) -> None:
    with open(root / "data.jsonl", "w") as f:
        for question in _QUESTIONS:
            for topic, answer in _CHAT:
                messages = [{"role": "user", "content": question.format(topic)},
                            {"role": "assistant", "content": answer}]
                f.write(json.dumps({"messages": messages}) + "\n")
    texts = [answer for _, answer in _CHAT]
    texts += [f"Here is one more line about {topic}: {answer[0].lower()}{answer[1:]}" for topic, answer in _CHAT]
    (root / "text.txt").write_text("".join(t + "\n" for t in texts))
    (root / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="2",
        TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", MPLBACKEND="Agg",
        PATH=os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p),
    )
    return env


def forkable(block: Block) -> bool:
    """Whether `block` may run in a process forked from the server (else in a fresh interpreter)."""
    return block.lang == "python" and not needs_fresh(block.code) and not os.environ.get("HF_MOE_README_FRESH")


def zygote_imports(blocks: list[Block]) -> list[str]:
    """What the server imports before it forks: the top-level import statements of the forkable `blocks`, each once.
    These imports are most of a block's time; run earlier, they do the same thing once instead of once a block."""
    statements = ["import hf_moe"]
    for block in blocks:
        try:
            tree = ast.parse(block.code) if forkable(block) and block.skip is None else ast.Module(body=[])
        except SyntaxError:  # the block fails as written, in its own test
            continue
        statements += [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    return list(dict.fromkeys(statements))


def _run(cmd: list[str], cwd: Path, timeout: float = TIMEOUT_S, env: dict[str, str] | None = None
         ) -> tuple[int | None, str]:
    """(exit status, or None on timeout; stdout and stderr interleaved). The whole process group is killed on
    timeout, so the children of a bash block go too."""
    process = subprocess.Popen(cmd, cwd=cwd, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        status = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        status = None
    return status, _final_lines(output.decode(errors="replace"))


def _final_lines(output: str) -> str:
    """`output` as a terminal would leave it: of a line redrawn with carriage returns (a progress bar) only its last
    state, and nothing of one erased at the end."""
    lines = []
    for line in output.split("\n"):
        shown = ""
        for part in line.split("\r"):  # each part overwrites the start of the line
            shown = part + shown[len(part):]
        if shown.strip() or "\r" not in line:
            lines.append(shown.rstrip() if "\r" in line else line)
    return "\n".join(lines)


@pytest.fixture(scope="session")
def readme_zygote(tmp_path_factory):
    """The fork server of this test process (one per xdist worker), started on first use. It runs the python blocks
    and the `hf-moe` and `python` commands of the bash blocks (`bash_env`)."""
    imports = zygote_imports([block for document in DOCUMENTS for block in _blocks(document)[0]])
    folder = tmp_path_factory.mktemp("readme-zygote")
    (folder / "bin").mkdir()
    server = Zygote(imports, _env(), str(folder / "server.log"), commands=str(folder / "bin"))
    yield server
    server.close()


@pytest.fixture(scope="session")
def bash_env(readme_zygote) -> dict[str, str]:
    """The environment of the bash blocks: `hf-moe` and `python` run in children of the fork server where they can
    (tests/readme_zygote.py says when), unless HF_MOE_README_FRESH is set."""
    if os.environ.get("HF_MOE_README_FRESH"):
        return _env()
    if readme_zygote.ready() != "ok":  # every command then costs its imports again: say so, as for python blocks
        warnings.warn(f"the bash blocks' commands run in fresh interpreters: {readme_zygote.ready()}")
    return readme_zygote.command_env(_env())


@pytest.fixture(scope="session")
def readme_fixtures(tmp_path_factory, bash_env) -> Path:
    """The files README.md refers to, built once: dense-model, moe-model, data.jsonl, text.jsonl, text.txt."""
    root = tmp_path_factory.mktemp("readme-fixtures")
    tiny_dense("llama").save_pretrained(root / "dense-model")
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(root / "dense-model")
    cmd = ["hf-moe", "convert", "dense-model", "moe-model", "--num-experts", "4", "--top-k", "2"]
    status, output = _run(cmd, root, env=bash_env)
    assert status == 0, f"building the README fixtures: {' '.join(cmd)} exited with {status}:\n{output}"
    _write_data(root)
    return root


def _run_forked(zygote: Zygote, script: Path, cwd: Path) -> tuple[int | None, str]:
    """As `_run([python, script], cwd)`, in a child of the server; Refused when it cannot."""
    output = script.with_suffix(".out")
    status = zygote.run(str(script), str(cwd), _env(), str(output), TIMEOUT_S)
    return status, _final_lines(output.read_bytes().decode(errors="replace"))


@pytest.fixture
def block_dir(readme_fixtures, tmp_path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(readme_fixtures, work)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in REPO_FOLDERS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, work / name, ignore=ignore)
    return work


# ------------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("document", DOCUMENTS, ids=_name)
def test_readme_blocks_are_well_formed(document: Path):
    """Nothing is silently not run: every block is python, bash, text or untagged; every skip comment has a reason
    and sits right before a runnable block; runnable blocks hold no interactive prompts."""
    blocks, problems = _blocks(document)
    assert not problems, f"{document}:\n" + "\n".join(problems)
    if document == README:
        assert any(b.lang in RUN_LANGUAGES for b in blocks), f"{document} has no ```python or ```bash block"


def test_readme_is_a_short_front_door_to_every_page():
    """The README stays short, and links every page of docs/ (a page nobody can find is not documentation)."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    assert [p for p in pages if f"(docs/{p})" not in text and f"(docs/{p}#" not in text] == []


@pytest.mark.subprocess
@pytest.mark.parametrize("document, block", _params())
def test_readme_block(document: Path, block: Block, block_dir: Path, request):
    prompt = "$ " if block.lang == "bash" else ">>> "
    prompts = _prompt_lines(block.code, prompt)
    if prompts:
        pytest.fail(f"{_name(document)} line {block.line + 1 + prompts[0][0]}: {prompts[0][1]}\n{_numbered(block)}",
                    pytrace=False)
    if block.lang == "python":
        script = block_dir.parent / f"readme_L{block.line}.py"  # outside the working directory the block sees
        script.write_text(block.code)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.code]
    forked = None
    if forkable(block):
        try:
            forked = _run_forked(request.getfixturevalue("readme_zygote"), script, block_dir)
        except Refused as why:  # a server that cannot fork costs every block its imports again: say so
            warnings.warn(f"{_name(document)} line {block.line} ran in a fresh interpreter: {why}")
    env = request.getfixturevalue("bash_env") if block.lang == "bash" else None
    status, output = forked if forked is not None else _run(cmd, block_dir, env=env)
    if status == 0:
        return
    what = f"timed out after {TIMEOUT_S} s" if status is None else f"failed with exit status {status}"
    tail = "\n".join(output.splitlines()[-TAIL_LINES:])
    pytest.fail(
        f"{_name(document)} line {block.line}: the ```{block.lang} block {what} (in {block_dir})\n"
        f"--- block ---\n{_numbered(block)}\n--- last {TAIL_LINES} lines of output ---\n{tail}",
        pytrace=False,
    )


def _numbered(block: Block) -> str:
    return "\n".join(f"{block.line + 1 + k:5d} | {line}" for k, line in enumerate(block.code.splitlines()))


# ------------------------------------------------------------------------------------------------- the parser
_SAMPLE = """\
# Title

```python
print("run me")
```

<!-- readme-test: skip: needs a GPU -->

```bash
nvidia-smi
```

1. A list item:

   ```bash
   echo indented
     echo more
   ```

```text
$ hf-moe inspect moe-model
output
```

```
a/
  tree
```

<!-- readme-test: skip: downloads
     a model -->
````python
x = '''
```
'''
````

~~~bash
echo tilde
~~~
"""


def test_parse_blocks_sample():
    blocks, problems = parse_blocks(_SAMPLE)
    assert problems == []
    assert [(b.id, b.skip) for b in blocks] == [
        ("L3-python", None), ("L9-bash", "needs a GPU"), ("L15-bash", None), ("L20-text", None),
        ("L25-untagged", None), ("L32-python", "downloads a model"), ("L38-bash", None),
    ]
    assert blocks[0].code == 'print("run me")\n'
    assert blocks[2].code == "echo indented\n  echo more\n"
    assert blocks[5].code == "x = '''\n```\n'''\n"


@pytest.mark.parametrize(
    "markdown, problem",
    [
        ("```sh\nls\n```\n", "line 1: unknown fence language 'sh'"),
        ("```console\nls\n```\n", "line 1: unknown fence language 'console'"),
        ("```bash\nls\n", "line 1: the ```bash block is never closed"),
        ("<!-- readme-test: skip: why -->\nSome prose.\n```bash\nls\n```\n", "line 1: dangling readme-test comment"),
        ("```bash\nls\n```\n<!-- readme-test: skip: why -->\n", "line 4: dangling readme-test comment at the end"),
        ("<!-- readme-test: skip: a -->\n<!-- readme-test: skip: b -->\n```bash\nls\n```\n",
         "line 1: dangling readme-test comment (another one follows it)"),
        ("<!-- readme-test: skip:   -->\n```bash\nls\n```\n", "line 1: readme-test skip comment without a reason"),
        ("<!-- readme-test: skip -->\n```bash\nls\n```\n", "line 1: malformed readme-test comment"),
        ("<!-- readme-test: run: now -->\n```bash\nls\n```\n", "line 1: malformed readme-test comment"),
        ("<!-- readme-test: skip: output -->\n```text\nls\n```\n", "line 1: a readme-test skip comment is attached"),
        ("```bash\nls\n$ hf-moe inspect out\n```\n", "line 3: a line starts with the prompt '$'"),
        ("```python\n>>> import hf_moe\n```\n", "line 2: a line starts with the prompt '>>>'"),
    ],
)
def test_parse_blocks_problems(markdown, problem):
    _, problems = parse_blocks(markdown)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_final_lines():
    output = "a\nLoad:  0%\rLoad: 100%\nSave: 0%\r          \r\nb\r\n\nc"
    assert _final_lines(output) == "a\nLoad: 100%\nb\n\nc"


def test_parse_blocks_skip_reaches_the_block():
    blocks, problems = parse_blocks("<!-- readme-test: skip: slow -->\n```bash\nls\n```\n")
    assert problems == [] and blocks == [Block(2, "bash", "ls\n", "slow")]
    params = [p for p in _params()]  # the documents' own blocks: skipped ones carry their reason
    for param in params:
        document, block = param.values
        assert param.id == f"{_name(document)}:{block.id}"
        assert any(m.name == ("skip" if block.skip else "slow") for m in param.marks)
