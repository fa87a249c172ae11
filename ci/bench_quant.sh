#!/bin/bash
# Quantization benchmark (docs/benchmarks.md, issue 12): the embedded SmolLM2 GGUF on the CPU backend, float32 dense
# (--quantization none), bfloat16 dense (--dtype bfloat16), Q4_1 packed (the default) and INT8 W8A8 (the same
# weights dequantized to an fp32 folder, then made compressed-tensors W8A8 by round-to-nearest), alternated over ROUNDS
# rounds; batch-1 decode (1 prompt x 16 -> 128 tokens) and batch-64 throughput (64 x 32 -> 64), each in its own
# process so peak RSS and cold start are per configuration. Then the llama.cpp anchor (ci/llama_cpp_anchor.py) when
# LLAMA_PY points at a python with gpt4all 2.8.2 (a separate venv). Usage: ci/bench_quant.sh [OUT_DIR] [ROUNDS]
set -euo pipefail
OUT=${1:-/tmp/bench-quant}; ROUNDS=${2:-2}
mkdir -p "$OUT"
W8A8="$OUT/smollm2-w8a8"
[ -f "$W8A8/config.json" ] || python - "$W8A8" <<'PY'
import sys
from pagedllm.bench.peer import hf_folder
from pagedllm.models.paths import default_model_path
from pagedllm.quantization.rtn import quantize_folder
quantize_folder(hf_folder(str(default_model_path())), sys.argv[1], "w8a8")
PY
B="python -m pagedllm.cli bench throughput --device cpu --max-model-len 512 --kv-cache-memory 268435456"
for round in $(seq 1 "$ROUNDS"); do
  for cfg in fp32 q4_1 bf16 w8a8; do
    case $cfg in fp32) F="--quantization none";; q4_1) F="";; bf16) F="--dtype bfloat16";; w8a8) F="--model $W8A8";; esac
    $B $F --num-prompts 1 --input-len 16 --output-len 128 --repeats 3 --json "$OUT/b1-$cfg-$round.json" >/dev/null 2>&1
    $B $F --num-prompts 64 --input-len 32 --output-len 64 --repeats 2 --json "$OUT/b64-$cfg-$round.json" >/dev/null 2>&1
  done
  if [ -n "${LLAMA_PY:-}" ]; then
    GGUF=$(python -c 'from pagedllm.models.paths import default_model_path as p; print(p())')
    "$LLAMA_PY" ci/llama_cpp_anchor.py --gguf "$GGUF" --tokens 128 --repeats 3 --threads "$(nproc)" \
      --json "$OUT/llamacpp-$round.json" >/dev/null 2>&1
  fi
done
python - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
def load(pat):
    return [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{pat}"))]
print("| config | batch-1 decode tok/s (per round) | batch-64 output tok/s (per round) | peak RSS MB (b1) | cold start s (b1) |")
print("|---|---|---|---|---|")
def col(rows, key, fmt):
    return " / ".join(format(r[key], fmt) for r in rows)
for cfg in ("fp32", "bf16", "q4_1", "w8a8"):
    b1, b64 = load(f"b1-{cfg}-*.json"), load(f"b64-{cfg}-*.json")
    print(f"| {cfg} | {col(b1, 'output_tok_s', '.1f')} | {col(b64, 'output_tok_s', '.0f')} | "
          f"{col(b1, 'peak_rss_mb', '.0f')} | {col(b1, 'cold_start_s', '.1f')} |")
for r in load("llamacpp-*.json"):
    print(f"llama.cpp (gpt4all 2.8.2): decode median {r['median_decode_tok_s']:.1f} tok/s, load {r['load_s']:.2f} s")
PY
