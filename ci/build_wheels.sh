#!/usr/bin/env bash
# Build wheels of core and every in-repo plugin into dist/ (or $1), so that
#   pip install --find-links dist "pagedllm[cpu]"     (or any other backend extra)
# resolves in a fresh venv: each extra names a plugin distribution built here.
# Each wheel is built in pip's isolated build environment, so the declared build requirements (setuptools>=68)
# are installed there whatever the running Python has (a system setuptools 65 rejects `project.license`).
# PYTHON picks the interpreter (default: python3); tests/core/test_wheels.py runs this the README's way.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-dist}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for src in . plugins/*/; do
  if ! "$PY" -m pip wheel -q --no-deps -w "$OUT" "$src" > "$log" 2>&1; then
    echo "build_wheels: building $src failed:" >&2
    grep -v -E '^WARNING: Location' "$log" | tail -25 >&2
    exit 1
  fi
done
ls "$OUT"/*.whl
