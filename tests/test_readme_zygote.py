"""The fork server of tests/test_readme.py (tests/readme_zygote.py): a python block, and a bash block's `hf-moe` and
`python` commands, run in a child of the server as a fresh interpreter would run them; what runs fresh instead."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from readme_zygote import Refused, Zygote
from test_readme import Block, _env, _run, _run_forked, forkable, zygote_imports

_SCRIPTS = {
    "facts": "import os, sys\nprint(sys.argv, os.getcwd(), sys.path[0], __name__, os.environ.get('HF_HUB_OFFLINE'))\n"
             "print('to stderr', file=sys.stderr)\n",
    "exit_3": "import sys\nsys.exit(3)\n",
    "exit_message": "import sys\nsys.exit('a message')\n",
    "raises": "raise ValueError('the last line')\n",
    "at_exit": "import atexit, threading, time\natexit.register(print, 'atexit ran')\n"
               "threading.Thread(target=lambda: (time.sleep(0.2), print('thread joined'))).start()\n",
}


@pytest.fixture(scope="module")
def light_zygote(tmp_path_factory):
    folder = tmp_path_factory.mktemp("light-zygote")
    (folder / "bin").mkdir()
    server = Zygote(["import json"], _env(), str(folder / "server.log"), commands=str(folder / "bin"))
    yield server
    server.close()


@pytest.mark.subprocess
@pytest.mark.parametrize("name", sorted(_SCRIPTS))
def test_a_forked_block_runs_as_a_fresh_interpreter_runs_it(name, light_zygote, tmp_path):
    """Same exit status, same output (stdout and stderr in one), same argv, cwd, sys.path[0], __name__, environment;
    an exception's traceback ends the same way."""
    script, cwd = tmp_path / f"{name}.py", tmp_path / "work"
    script.write_text(_SCRIPTS[name])
    cwd.mkdir()
    fresh = _run([sys.executable, str(script)], cwd)
    forked = _run_forked(light_zygote, script, cwd)
    if name == "raises":
        assert fresh[0] == forked[0] == 1 and fresh[1].splitlines()[-2:] == forked[1].splitlines()[-2:]
    else:
        assert forked == fresh and fresh[0] == {"exit_3": 3, "exit_message": 1}.get(name, 0)


@pytest.mark.subprocess
def test_a_forked_block_that_runs_too_long_is_killed_with_its_children(light_zygote, tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import subprocess, sys\nprint(subprocess.Popen(['sleep', '60']).pid, flush=True)\n"
                      "subprocess.run(['sleep', '60'])\n")
    status = light_zygote.run(str(script), str(tmp_path), _env(), str(tmp_path / "out"), timeout=2)
    assert status is None
    grandchild = int((tmp_path / "out").read_text().split()[0])
    with pytest.raises(ProcessLookupError):  # gone with its session (a zombie of init at most, for a moment)
        for _ in range(50):
            os.kill(grandchild, 0)
            time.sleep(0.1)
    (tmp_path / "ok.py").write_text("print('the server serves on')\n")
    assert light_zygote.run(str(tmp_path / "ok.py"), str(tmp_path), _env(), str(tmp_path / "out"), 60) == 0


# A script that says where it runs: a child of the light server has imported json, a fresh interpreter has not.
_WHERE = ("import json, os, sys\n"
          "print('forked' if 'json' in sys.modules else 'fresh', sys.argv, sys.path[0], os.getcwd())\n"
          "print('to stderr', file=sys.stderr)\nsys.exit(int(sys.argv[1]))\n")
_COMMANDS = {  # a bash command: where its stand-in runs it
    "python where.py 3; echo status $?": "forked",
    "python where.py 0 2>&1 | cat": "forked",  # the pipe ends when the command does: the server keeps no end of it
    "python -m json.tool <<< '{\"a\": 1}'": "forked",  # stdin is the block's
    "hf-moe --help | cat": "forked",
    "FOO=1 python where.py 0": "fresh",  # an environment the server's imports did not see
    "python -c 'import where' 0": "fresh",  # a form the server does not take
    "python fresh.py": "fresh",  # a script that must run fresh
}


@pytest.mark.subprocess
@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_a_bash_blocks_command_runs_as_the_real_program_runs_it(command, light_zygote, tmp_path):
    """The stand-ins of `hf-moe` and `python` give the same output, exit status, argv, cwd and sys.path[0] as the
    programs, run in a child of the server or, where it must, by the programs themselves."""
    (tmp_path / "where.py").write_text(_WHERE)
    (tmp_path / "fresh.py").write_text("import os\nos.environ['OMP_NUM_THREADS'] = '1'\nimport where\n")
    served = _run(["bash", "-euo", "pipefail", "-c", command], tmp_path, env=light_zygote.command_env(_env()))
    real = _run(["bash", "-euo", "pipefail", "-c", command], tmp_path)
    assert served == (real[0], real[1].replace("fresh", _COMMANDS[command])), (served, real)


@pytest.mark.subprocess
def test_a_bash_block_that_runs_too_long_is_killed_with_its_forked_command(light_zygote, tmp_path):
    (tmp_path / "sleeps.py").write_text("import subprocess\nprint(subprocess.Popen(['sleep', '60']).pid, flush=True)\n"
                                        "subprocess.run(['sleep', '60'])\n")
    env = light_zygote.command_env(_env())
    status, output = _run(["bash", "-c", "python sleeps.py > pid"], tmp_path, timeout=3, env=env)
    assert status is None, output
    grandchild = int((tmp_path / "pid").read_text().split()[0])
    with pytest.raises(ProcessLookupError):  # killed by the server when the stand-in went
        for _ in range(50):
            os.kill(grandchild, 0)
            time.sleep(0.1)
    assert _run(["bash", "-c", "python -m json.tool <<< 1"], tmp_path, env=env) == (0, "1\n")


@pytest.mark.subprocess
def test_the_server_refuses_to_fork_beside_a_thread(tmp_path):
    """A thread the imports started would be missing in the child (and could hold a lock there): the block runs
    fresh instead."""
    start = "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start()"
    server = Zygote([start], _env(), str(tmp_path / "server.log"))
    try:
        (tmp_path / "ok.py").write_text("print('hi')\n")
        with pytest.raises(Refused, match="2 Python threads"):
            server.run(str(tmp_path / "ok.py"), str(tmp_path), _env(), str(tmp_path / "out"), 60)
    finally:
        server.close()


def test_which_blocks_fork_and_what_the_server_imports():
    plain = Block(1, "python", "import torch\nfrom transformers import AutoConfig as C\nx = 1\nimport json\n")
    sets_env = Block(1, "python", "import os\nos.environ['OMP_NUM_THREADS'] = '1'\nimport torch\n")
    assert forkable(plain) and not forkable(sets_env) and not forkable(Block(1, "bash", "python x.py\n"))
    assert not forkable(Block(1, "python", "import torch.distributed as dist\ndist.init_process_group('gloo')\n"))
    skipped = Block(1, "python", "import vllm\n", skip="needs a GPU")
    broken = Block(1, "python", "import (\n")
    assert zygote_imports([plain, sets_env, skipped, broken, plain]) == [
        "import hf_moe", "import torch", "from transformers import AutoConfig as C", "import json",
    ]


@pytest.mark.subprocess
def test_fresh_python_forks_what_cannot_differ_and_runs_the_rest_fresh(fresh_python, tmp_path):
    """tests/fresh_python.py: `python -c` with stdout and stderr apart, its exit status and arguments; forked (the
    server's transformers already imported, hf_moe not) when only HF_MOE_* differs, fresh when anything else does;
    a timeout raises as subprocess.run's does."""
    code = ("import os, sys\nprint(sys.argv, sys.path[0] == '', os.getcwd(), os.environ.get('HF_MOE_X'),\n"
            "      'transformers.modeling_utils' in sys.modules, 'hf_moe' in sys.modules)\n"
            "print('to stderr', file=sys.stderr)\nsys.exit(4)\n")
    forked_before = fresh_python.forked
    forked = fresh_python.run(code, "a", 2, set_env={"HF_MOE_X": "1"}, cwd=tmp_path)
    assert fresh_python.forked == forked_before + 1
    assert (forked.returncode, forked.stderr) == (4, "to stderr\n")
    assert forked.stdout == f"['-c', 'a', '2'] True {tmp_path} 1 True False\n"
    fresh = fresh_python.run(code, "a", set_env={"HF_MOE_X": "1", "SOME_OTHER": "1"}, cwd=tmp_path)
    assert fresh_python.forked == forked_before + 1
    assert (fresh.returncode, fresh.stderr) == (4, "to stderr\n")
    assert fresh.stdout == f"['-c', 'a'] True {tmp_path} 1 False False\n"
    with pytest.raises(subprocess.TimeoutExpired):
        fresh_python.run("import time; time.sleep(60)", timeout=2)
