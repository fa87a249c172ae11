#!/usr/bin/env bash
# The test command (README): set up the venv, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
# The terminal tests drive `pagedllm chat` in tmux (a real terminal); Debian's package when it is missing.
if ! command -v tmux >/dev/null; then
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  { $sudo apt-get update -q && $sudo apt-get install -y -q tmux; } > .venv/apt-tmux.log 2>&1 || { tail -20 .venv/apt-tmux.log; exit 1; }
fi
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q --durations=30 "$@"
