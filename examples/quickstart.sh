#!/usr/bin/env bash
# The main job on a fresh machine: install, then convert SmolLM2-135M-Instruct to an 8-expert top-2 MoE, check
# that it answers like the dense model, fine-tune it briefly, save it per expert, reload it and generate.
# About 13 minutes on 2 CPU cores (README.md). Extra arguments go to examples/smollm2_moe.py (e.g. --max-steps 20).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install torch==2.13.0
python -m pip install -e ".[data,gguf]"
python examples/smollm2_moe.py "$@"
