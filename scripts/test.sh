#!/usr/bin/env bash
# Install everything and run the whole test suite. This is the README's test command; CI runs it (.ci/run).
# torch==2.13.0 goes in first (on this project's machines it is a local CPU build); a looser `torch` requirement
# resolved on its own would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install torch==2.13.0
python -m pip install -e ".[dev]"
python -m pytest "$@"
