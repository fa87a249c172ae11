#!/usr/bin/env bash
# Build wheels of core and every in-repo plugin into dist/ (or $1), so that
#   pip install --find-links dist "pagedllm[cpu]"     (or any other backend extra)
# resolves in a fresh venv: each extra names a plugin distribution built here.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-dist}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
for src in . plugins/*/; do
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$src" 2>&1 | grep -v -E '^WARNING: Location|Deprecat|^ +|^\*+|!!' || true
done
ls "$OUT"/*.whl
