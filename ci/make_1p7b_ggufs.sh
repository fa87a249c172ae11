#!/usr/bin/env bash
# Issue 32's 1.7B workload as GGUF files written by llama.cpp's own tools: `pagedllm bench random-model
# smollm2-1.7b` (seeded bf16 safetensors + the embedded SmolLM2 tokenizer) -> llama.cpp's convert_hf_to_gguf.py
# (BF16, lossless) -> llama-quantize to each type; then `pagedllm bench gguf-parity` checks that pagedllm runs each
# file on its packed kernels and that its greedy first tokens equal the file dequantized to float32.
# Usage: ci/make_1p7b_ggufs.sh [OUT_DIR]   (default ~/.cache/pagedllm/ggufs/smollm2-1.7b-seed$SEED)
# Needs the peer build of ci/setup_llamacpp_peer.sh (PAGEDLLM_LLAMA_CPP, default ~/.cache/pagedllm/llama.cpp-b11434).
# Idempotent (finished files are kept), quiet (the tools' output: OUT_DIR/make.log). ~10 GB of disk at the end
# (HF folder 3.4 GB, BF16 3.4 GB, the four quantized files 4.5 GB); the parity check loads each file twice, the
# reference in float32 (~7 GB of memory).
# Env: TYPES (default "Q8_0 Q4_K_M Q6_K Q5_K_M"), SEED (0), CHECK (1; 0 skips the parity check), TOKENS (greedy
# tokens compared, 16), PYTHON (default the repo's .venv python), NICE (default 0).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
seed=${SEED:-0}
out=${1:-$HOME/.cache/pagedllm/ggufs/smollm2-1.7b-seed$seed}
lcpp=${PAGEDLLM_LLAMA_CPP:-$HOME/.cache/pagedllm/llama.cpp-b11434}
types=${TYPES:-Q8_0 Q4_K_M Q6_K Q5_K_M}
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x "$repo/.venv/bin/python" ]; then py=$repo/.venv/bin/python
else py=python3; fi
run() { nice -n "${NICE:-0}" "$@"; }
for tool in llama-quantize convert_hf_to_gguf; do
  [ -x "$lcpp/bin/$tool" ] || { echo "no $tool in $lcpp/bin: run ci/setup_llamacpp_peer.sh first" >&2; exit 1; }
done
mkdir -p "$out"
log=$out/make.log
step() {  # step "what" command...: quietly into the log; on failure show its tail and stop
  local label=$1; shift
  echo "$label"
  if ! { echo "== $label"; run "$@"; } >> "$log" 2>&1; then
    echo "make_1p7b_ggufs failed at: $label (full output: $log)" >&2
    tail -25 "$log" >&2
    exit 1
  fi
}

[ -f "$out/hf/random_model.json" ] || step "random model smollm2-1.7b, seed $seed (bf16 safetensors)" \
  "$py" -m pagedllm.cli bench random-model --preset smollm2-1.7b --seed "$seed" --dtype bfloat16 --out "$out/hf"
bf16=$out/smollm2-1.7b-BF16.gguf
if [ ! -f "$bf16" ]; then
  step "convert_hf_to_gguf -> BF16" "$lcpp/bin/convert_hf_to_gguf" "$out/hf" --outtype bf16 --outfile "$bf16.part"
  mv "$bf16.part" "$bf16"
fi
files=()
for t in $types; do
  f=$out/smollm2-1.7b-$t.gguf
  if [ ! -f "$f" ]; then
    step "llama-quantize -> $t" "$lcpp/bin/llama-quantize" "$bf16" "$f.part" "$t" "$(nproc)"
    mv "$f.part" "$f"
  fi
  files+=("$f")
done
echo "llama.cpp $(sed -n 's/^build=//p' "$lcpp/BUILD_INFO" 2>/dev/null || echo '(unknown build)') wrote:"
ls -l "$bf16" "${files[@]}" | awk '{printf "  %8.0f MB  %s\n", $5 / 1e6, $NF}'
if [ "${CHECK:-1}" != 0 ]; then
  echo "pagedllm bench gguf-parity (packed kernels, greedy ${TOKENS:-16} tokens vs the dequantized float32 reference):"
  if ! run "$py" -m pagedllm.cli bench gguf-parity --tokens "${TOKENS:-16}" --json "$out/parity.json" "${files[@]}" \
    2>> "$log"; then
    echo "gguf-parity failed (full output: $log)" >&2
    tail -5 "$log" >&2
    exit 1
  fi
fi
