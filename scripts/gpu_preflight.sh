# Sourced by scripts/first_light.sh and scripts/gpu_bench.sh (not run by itself): what both print and check before
# their Python command runs, so that a machine whose packages cannot import hf_moe still leaves a report.
#
#   preflight TITLE PACKAGE...   prints python's version and each PACKAGE's ("missing" where absent), then imports
#                                hf_moe; if that fails, prints the traceback, writes $OUT/report.md headed "# TITLE"
#                                with the verdict and the traceback, and returns 1. Needs $PYTHON and $OUT.
preflight() {
    local title=$1
    shift
    "$PYTHON" - "$@" <<'EOF'
import importlib.metadata as m, platform, sys
names = sys.argv[1:]
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "missing"
print(f"python {platform.python_version()}; " + ", ".join(f"{n} {version(n)}" for n in names))
EOF
    if ! "$PYTHON" -c "import hf_moe" 2>"$OUT/import_error.txt"; then
        cat "$OUT/import_error.txt"
        {
            echo "# $title"
            echo
            echo "- verdict: FAILED (\`import hf_moe\` failed: no step ran)"
            echo
            echo '```text'
            cat "$OUT/import_error.txt"
            echo '```'
        } >"$OUT/report.md"
        rm -f "$OUT/import_error.txt"
        return 1
    fi
    rm -f "$OUT/import_error.txt"
}
