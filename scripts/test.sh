#!/usr/bin/env bash
# Install everything and run the whole test suite, then the oldest transformers the bounds admit (scripts/test_oldest.sh).
# This is the README's test command; CI runs it (.ci/run). Tests are chosen by marker (pyproject.toml), never by name.
#   bash scripts/test.sh               the whole suite (every test but the `gpu_versions` ones), then test_oldest.sh
#   bash scripts/test.sh --fast        the inner loop: no install, none of the slow, subprocess, distributed, compile
#                                      or gpu_versions tests (a few minutes on a 2-core machine)
#   bash scripts/test.sh --durations   the install and the whole suite, writing every test's time to
#                                      benchmarks/results/test_durations.txt (not test_oldest.sh)
# Arguments after these go to pytest (e.g. `--fast tests/test_ops.py`, `--fast -x`).
# torch==2.13.0 goes in first (on this project's machines it is a local CPU build); a looser `torch` requirement
# resolved on its own would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS="${HF_MOE_TEST_WORKERS:-2}"
if [ "${1:-}" = "--fast" ]; then
    shift
    exec python -m pytest -n "$WORKERS" --dist worksteal -q \
        -m "not (slow or subprocess or distributed or compile or gpu_versions)" "$@"
fi
durations=""
if [ "${1:-}" = "--durations" ]; then
    shift
    durations=benchmarks/results/test_durations.txt
fi
python -c "import torch" 2>/dev/null || python -m pip install torch==2.13.0
# What builds against the installed torch (pip's isolated build environment would pull a CUDA torch) needs its build
# tools in place: setuptools and wheel, and ninja, which compiles the C++ extension's files in parallel.
python -m pip install "setuptools>=70.1" wheel ninja
# hf_moe with its C++ extension built ahead of time (hf_moe._C, in hf_moe/; setup.py): the whole suite runs on it, so
# csrc/ is compiled once (tests/test_extension.py checks this build, and the on-first-use build's machinery on a
# stub). Built only when the one there is not current (its stamp: the sources, flags, Python and torch install), as
# the on-first-use build is kept in its cache.
# The build must be this checkout's own hf_moe/_C*.so: an editable install of another tree (a machine image's earlier
# checkout) also answers `import hf_moe._C`, and its current build must not stand in for a missing one here.
prebuilt_is_current() {
    python -c "import pathlib, importlib.util; from hf_moe.ops import extension; \
spec = importlib.util.find_spec('hf_moe._C'); here = pathlib.Path('hf_moe').resolve(); \
assert spec and spec.origin and pathlib.Path(spec.origin).resolve().parent == here, f'no hf_moe._C built in {here}'; \
assert extension._prebuilt(), 'hf_moe._C is stale'"
}
ext=1
prebuilt_is_current 2>/dev/null && ext=0
HF_MOE_BUILD_EXT=$ext python -m pip install --no-build-isolation -e ".[dev]"
# The newest transformers the bound in pyproject.toml admits (an existing venv would keep an older one), and a check
# that it is the newest release hf_moe records as tested (hf_moe/compat.py TESTED; docs/compatibility.md).
python -m pip install --upgrade "$(grep -o '"transformers[^"]*"' pyproject.toml | tr -d '"')"
python -c "import transformers; from hf_moe.compat import TESTED; newest = TESTED['transformers'][1]; \
assert transformers.__version__.split('.')[:2] == newest.split('.')[:2], (transformers.__version__, newest)"
# DeepSpeed (the ZeRO-3 test of tests/test_tools.py) is such an sdist, installed with no ops compiled ahead, at the
# version of hf_moe's `deepspeed` extra (`-e ".[deepspeed]"` would build hf_moe's editable wheel a second time). Its
# test skips without it.
DS_BUILD_OPS=0 python -m pip install --no-build-isolation "$(grep -o '"deepspeed==[^"]*"' pyproject.toml | tr -d '"')" \
    || echo "deepspeed did not install: the ZeRO-3 test of tests/test_tools.py will skip"
prebuilt_is_current
# The suite runs on two workers (pytest-xdist; HF_MOE_TEST_WORKERS to change): most tests use one core, so two workers
# cut the wall time on a 2-core machine (measured: docs/compatibility.md). Tests, not files, are shared out, and an
# idle worker takes the rest of the other's queue (worksteal): with a file per worker, the README's blocks (a hundred
# fresh processes) kept one worker busy long after the other had finished.
# The tests marked gpu_versions concern the lent GPU alone and run once, in scripts/test_oldest.sh on the GPU's own
# versions (torch 2.11, triton 3.6), not here as well.
SUITE=(python -m pytest -n "$WORKERS" --dist worksteal -m "not gpu_versions")
if [ -n "$durations" ]; then
    log="$(mktemp)"
    status=0
    "${SUITE[@]}" --durations=0 --durations-min=0 "$@" | tee "$log" || status=$?
    python scripts/test_durations.py "$log" "$durations" "${SUITE[*]} --durations=0"
    rm -f "$log"
    exit "$status"
fi
# The venv of scripts/test_oldest.sh (torch 2.11's wheels, a few GB to download and unpack) is built while the main
# suite runs; its log is printed after the suite.
oldest_log="$(mktemp)"
bash scripts/test_oldest.sh --venv-only >"$oldest_log" 2>&1 &
oldest_venv=$!
status=0
"${SUITE[@]}" "$@" || status=$?
venv_status=0
wait "$oldest_venv" || venv_status=$?
cat "$oldest_log"
rm -f "$oldest_log"
if [ "$status" -ne 0 ] || [ "$venv_status" -ne 0 ]; then
    echo "test.sh: the suite exited $status, building the oldest-versions venv exited $venv_status"
    exit 1
fi
bash scripts/test_oldest.sh
