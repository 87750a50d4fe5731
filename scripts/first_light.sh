#!/usr/bin/env bash
# First light on a lent GPU: the one command to run there, from the checkout, with the machine's own packages (nothing
# is installed; no network). It runs `python -m hf_moe.gpu_check` within a budget (default 420 s, so that one
# 10-minute device call holds it with room to spare) and leaves in $OUT (default: ./first_light) at most four files,
# none in a folder: report.md, results.json, logs.txt (gpu_check's; every step's whole output) and first_light.log
# (this script's output). docs/backends.md says what to do with the report.
#
#   bash scripts/first_light.sh                 # on the GPU machine, from the repository root or anywhere
#   BUDGET=300 bash scripts/first_light.sh      # a shorter run; PYTHON=python3.12 to pick the interpreter
#
# Exit status: gpu_check's (0: every step passed or was skipped, saying why; 1: a step failed, a Triton op fell back
# to torch included; 2: its command line was refused, e.g. a BUDGET under what the steps need, and nothing ran), or 1
# when hf_moe does not even import (report.md then holds the traceback), or 2 when BUDGET is not a number of seconds
# above 0 (nothing ran, nothing was written).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/first_light}"
BUDGET="${BUDGET:-420}"
PYTHON="${PYTHON:-python3}"
# Checked before anything runs: bash arithmetic below would read "abc" or "nan" as an unset variable and die with
# status 1, which means "a step failed". Digits with an optional fraction only (so no NaN, no infinity, no sign), and
# at most 7 before the point (bash arithmetic would wrap a longer number around).
if ! [[ "$BUDGET" =~ ^[0-9]{1,7}([.][0-9]+)?$ ]] || [[ "$BUDGET" =~ ^0+([.]0+)?$ ]]; then
    echo "first_light: BUDGET=${BUDGET@Q} is not a number of seconds above 0 (e.g. BUDGET=420); nothing ran." >&2
    exit 2
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_MOE_BACKEND="${HF_MOE_BACKEND:-triton}"  # never builds the C++ CPU extension (it is not what runs here)
unset TRITON_INTERPRET
source scripts/gpu_preflight.sh  # preflight: the versions, and a report when hf_moe does not import

run() {
    echo "== first light: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD 2>/dev/null \
        || echo unknown), budget ${BUDGET} s"
    preflight "hf_moe gpu_check" torch triton transformers accelerate safetensors numpy pytest || return 1
    # The budget is gpu_check's; the margin is for a step killed at its limit and for writing the report.
    timeout -k 10 "$((10#${BUDGET%.*} + 61))" "$PYTHON" -m hf_moe.gpu_check --out "$OUT" --budget "$BUDGET"
    local status=$?
    echo "== report: $OUT/report.md (exit status $status)"
    awk '/^## 1\. /{exit} {print}' "$OUT/report.md" 2>/dev/null  # the verdict, the steps' table, any fallbacks
    return "$status"
}

run 2>&1 | tee "$OUT/first_light.log"
exit "${PIPESTATUS[0]}"
