#!/usr/bin/env bash
# The oldest transformers release pyproject.toml admits, in a venv of its own (.venv-oldest), on the tests that
# touch transformers' internals most: modeling, loading and saving, conversion of every family, export, Trainer.
# The C++ kernels do not depend on transformers and are tested in the main run; this one uses the pure-torch ops.
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=5.17.0  # = hf_moe.compat.TESTED["transformers"][0] (tests/test_repo.py checks they agree)
VENV=.venv-oldest
[ -x "$VENV/bin/python" ] || python -m venv "$VENV"
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e ".[data,plot]" "transformers==$OLDEST" pytest pytest-timeout tensorboard
"$VENV/bin/python" -c "import transformers; assert transformers.__version__ == '$OLDEST', transformers.__version__"
HF_MOE_BACKEND=torch "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_modeling.py tests/test_integration.py tests/test_checkpoint.py tests/test_convert.py \
    tests/test_families.py tests/test_export.py tests/test_training.py tests/test_routers.py \
    tests/test_experts_interface.py tests/test_compat.py
