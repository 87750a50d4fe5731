#!/usr/bin/env bash
# The oldest releases hf_moe supports, which are the lent GPU's image (docs/backends.md, first light): Python 3.12,
# torch 2.11 (its PyPI wheel, the cu130 build, which runs on CPU), triton 3.6, transformers 5.17, accelerate 1.15,
# safetensors 0.8. Run from the checkout on PYTHONPATH with no `pip install -e`, as scripts/first_light.sh runs there:
#   * `import hf_moe`;
#   * the tests that touch transformers' internals most (modeling, loading and saving, conversion of every family,
#     export, Trainer, routers, the experts interface), on the pure-torch ops;
#   * the Triton kernels through triton 3.6's sm90 compiler, `python -m hf_moe.gpu_check --smoke` (triton 3.6's
#     interpreter, which needs numpy < 2.4) and scripts/first_light.sh, and the tests of torch's internals: expert
#     parallelism x FSDP2 with DTensors, torch.compile and torch.export of the custom ops.
# The venv lives outside the checkout ($HF_MOE_TEST_VENVS, default ~/.cache/hf_moe/venvs) and is reused while the
# versions below stay the same (a run that reuses it starts its tests soon after the call). On a fresh machine the
# venv costs gigabytes of wheels (torch's CUDA libraries) and of disk, and minutes to create (measured:
# docs/compatibility.md).
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=5.17.0  # = hf_moe.compat.TESTED["transformers"][0] (tests/test_repo.py checks they agree)
# = hf_moe.compat.TESTED's oldest torch, triton, accelerate and safetensors (tests/test_repo.py checks)
TORCH=2.11.0 TRITON=3.6.0 ACCELERATE=1.15.0 SAFETENSORS=0.8.0
PACKAGES=("torch==$TORCH" "triton==$TRITON" "transformers==$OLDEST" "accelerate==$ACCELERATE"
          "safetensors==$SAFETENSORS" "numpy<2.4" tqdm pyyaml xxhash pytest pytest-timeout pytest-xdist tensorboard
          matplotlib "datasets>=3.0")

# Python 3.12 where the machine has it (the lent GPU runs 3.12.3); pyenv's shim refuses a version it does not select.
PYTHON=""
for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    if "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
        PYTHON="$candidate"
        break
    fi
done
if [ -z "$PYTHON" ]; then
    PYTHON=python3
    echo "test_oldest: no Python 3.12 here (the lent GPU has 3.12.3); using $($PYTHON --version)"
fi

KEY="$("$PYTHON" -c 'import platform; print(platform.python_version())') ${PACKAGES[*]}"
VENV="${HF_MOE_TEST_VENVS:-$HOME/.cache/hf_moe/venvs}/oldest-$(printf '%s' "$KEY" | sha256sum | cut -c1-12)"
if [ "$(cat "$VENV/hf_moe-packages.txt" 2>/dev/null)" != "$KEY" ]; then
    start=$SECONDS
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "${PACKAGES[@]}"
    printf '%s' "$KEY" >"$VENV/hf_moe-packages.txt"
    echo "test_oldest: created $VENV in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))"
fi
if [ "${1:-}" = "--venv-only" ]; then  # scripts/test.sh builds the venv while the main suite runs
    exit 0
fi
PY="$VENV/bin/python"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "
import torch, transformers, triton, accelerate, safetensors
got = (torch.__version__.split('+')[0], triton.__version__, transformers.__version__, accelerate.__version__,
       safetensors.__version__)
assert got == ('$TORCH', '$TRITON', '$OLDEST', '$ACCELERATE', '$SAFETENSORS'), got
import hf_moe
print('test_oldest: import hf_moe from', hf_moe.__file__, 'on', ', '.join(got))
"
# The tests marked `oldest` (the transformers internals, then the device's own concerns: the Triton kernels (the
# interpreter and the sm90 compiler), expert parallelism x FSDP2 (DTensor, DCP), torch.export programs) and
# `gpu_versions` (gpu_check --smoke, whose kernel tests run on xdist workers as on the GPU, first_light.sh and the sm90
# compile of every Triton kernel, which run only here). Not marked: what does not depend on these versions and runs in
# the main suite (gpu_check's runner and fallback tests, the two Triton tests that build the C++ extension, the saved
# programs of the compiled backend, the DDP and launcher tests), tests/test_compile.py (parts of it fail on torch 2.11:
# docs/compatibility.md, known limits), and every kernel test under triton 3.6's interpreter (two minutes): the GPU
# compiles the kernels, which test_every_kernel_compiles_for_sm90 does here with triton 3.6's own front end and
# compiler, and gpu_check --smoke runs the interpreter on these versions; the main suite runs every kernel test under
# the interpreter (triton 3.9). Only the files that mark a test so are collected: the others import packages this venv
# does not have (peft, trl, onnx, ...).
# Of the `oldest` tests marked slow, this lane keeps those that launch processes, compile or run distributed (the
# versions' internals they reach change most between releases) and leaves the slow repetitions of one check over
# variants (every family's upcycling, every router's training run) to the main suite: their fast representatives run
# here, and the lane stays a few minutes (benchmarks/results/test_durations.txt).
mapfile -t FILES < <(grep -l -E "pytest\.mark\.(oldest|gpu_versions)" tests/test_*.py)
HF_MOE_BACKEND=torch "$PY" -m pytest -q -p no:cacheprovider -n "${HF_MOE_TEST_WORKERS:-2}" --dist worksteal \
    -m "(oldest and (not slow or distributed or compile or subprocess)) or gpu_versions" "${FILES[@]}" "$@"
