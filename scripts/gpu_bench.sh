#!/usr/bin/env bash
# Second light on a lent GPU: `python -m hf_moe.gpu_check.bench` (correctness at real shapes, the layer speed and
# memory against the dense MLP, transformers' grouped_mm, Liger-Kernel and SonicMoE, the main job with Trainer, save,
# reload and decode), within a budget that fits one device call with room for a rerun. It leaves in $OUT (default
# ./gpu_bench) at most five files, none in a folder: report.md, results.json, logs.txt, backends_table.md (the
# tables for docs/backends.md) and gpu_bench.log (this script's output). docs/backends.md says what to do with them.
#
#   bash scripts/gpu_bench.sh --fetch-wheels    # here, with a package registry: Liger-Kernel's wheel into .whl-bench/
#   bash scripts/gpu_bench.sh                   # on the GPU machine (no network): installs .whl-bench/*.whl first
#   bash scripts/gpu_bench.sh --smoke           # CPU, TRITON_INTERPRET=1, tiny shapes (CI)
#   BUDGET=300 bash scripts/gpu_bench.sh --steps layers,qwen3    # other arguments go to the bench
#
# Exit status: the bench's (0: every step passed or was skipped, saying why; 1: a step failed), or 1 when hf_moe does
# not even import (report.md then holds the traceback) or a wheel does not install.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="${WHEELS:-$PWD/.whl-bench}"
PYTHON="${PYTHON:-python3}"
LIGER="liger-kernel==0.8.5"

if [ "${1:-}" = "--fetch-wheels" ]; then
    # The device has no network and no Liger-Kernel: its wheel travels in $WHEELS (git-ignored; `run`'s carry).
    mkdir -p "$WHEELS"
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$WHEELS" "$LIGER" || exit 1
    ls -l "$WHEELS"
    exit 0
fi

SMOKE=0
for arg in "$@"; do [ "$arg" = "--smoke" ] && SMOKE=1; done
OUT="${OUT:-$PWD/gpu_bench}"
if [ "$SMOKE" = 1 ]; then BUDGET="${BUDGET:-900}"; else BUDGET="${BUDGET:-440}"; fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_MOE_BACKEND="${HF_MOE_BACKEND:-triton}"  # what auto runs for bf16 on sm90; never builds the C++ extension
unset TRITON_INTERPRET  # the bench sets it for --smoke only
source scripts/gpu_preflight.sh  # preflight: the versions, and a report when hf_moe does not import

run() {
    echo "== gpu_bench: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD 2>/dev/null \
        || echo unknown), budget ${BUDGET} s"
    if [ "$SMOKE" = 0 ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
        # --no-deps: Liger needs only torch and triton, which the machine has; its own copy, not the image's site
        local site=/tmp/gpu_bench_site
        if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$WHEELS"/*.whl; then
            echo "== a wheel in $WHEELS did not install"
            return 1
        fi
        export PYTHONPATH="$PYTHONPATH:$site"
        echo "== installed: $(cd "$WHEELS" && ls *.whl | tr '\n' ' ')"
    else
        echo "== no wheels installed (${WHEELS} has none, or --smoke): Liger-Kernel is reported absent unless installed"
    fi
    preflight "hf_moe gpu_check bench" torch triton transformers accelerate safetensors numpy liger-kernel || return 1
    # The budget is the bench's; the margin is for a step killed at its limit and for writing the report.
    timeout -k 10 "$((BUDGET + 40))" "$PYTHON" -m hf_moe.gpu_check.bench --out "$OUT" --budget "$BUDGET" "$@"
    local status=$?
    echo "== report: $OUT/report.md (exit status $status)"
    awk '/^## [0-9]+\. /{exit} {print}' "$OUT/report.md" 2>/dev/null  # the verdict and the steps' table
    return "$status"
}

run "$@" 2>&1 | tee "$OUT/gpu_bench.log"
exit "${PIPESTATUS[0]}"
