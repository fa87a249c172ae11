#!/usr/bin/env bash
# The test command (README): set up the venv, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"
