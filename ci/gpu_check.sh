#!/usr/bin/env bash
# GPU check for the cuda (or rocm) backend (CI has no GPU; run this where one is lent): conformance of every hook on the
# device (Triton kernels compiled for real, CUDA-graph replay vs eager, greedy parity with HF), then offline
# throughput of DESIGN.md's 19M-parameter Llama with CUDA graphs vs eager, fp32 and bf16; prints a short table.
# Installs nothing from the network: the checkout goes, --no-index --no-deps, into a throwaway venv that sees the
# machine's own torch, triton and transformers. About 2-4 minutes on an H200.
#   usage: ci/gpu_check.sh [OUT_DIR]      (default $OUT, else /tmp/pagedllm-gpu-check)
#   GPU_CHECK_DEVICE=rocm checks the rocm backend instead; GPU_CHECK_SKIP_INSTALL=1 uses the active environment
#   (a dry run of the plumbing on CPU: GPU_CHECK_SKIP_INSTALL=1 GPU_CHECK_DEVICE=cpu ci/gpu_check.sh /tmp/x).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/pagedllm-gpu-check}}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
mkdir -p "$OUT_DIR"
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]; then
  VENV=${GPU_CHECK_VENV:-/tmp/pagedllm-gpu-venv}
  [ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv --system-site-packages "$VENV"
  . "$VENV/bin/activate"
  pip install -q --no-index --no-deps --no-build-isolation -e . -e "plugins/$DEVICE" 2>&1 | grep -v -i warning || true
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
pagedllm backends || python -m pagedllm.cli backends

start=$(date +%s)
set +e
timeout 200 python -m pagedllm.conformance --device "$DEVICE" --report "$OUT_DIR" -q > "$OUT_DIR/conformance.txt" 2>&1
conf_rc=$?
set -e
conf_s=$(( $(date +%s) - start ))
tail -n 40 "$OUT_DIR/conformance.txt"

MODEL=/tmp/pagedllm-bench-llama
[ -f "$MODEL/config.json" ] || python -c "import sys; sys.path.insert(0, 'tests/support'); import tiny_models; tiny_models.make_bench_llama('$MODEL')"
bench() {  # name, extra args
  local name=$1; shift
  timeout 120 pagedllm bench throughput --model "$MODEL" --device "$DEVICE" --num-prompts 64 --input-len 32 \
    --output-len 64 --max-num-seqs 64 --json "$OUT_DIR/bench-$name.json" "$@" > "$OUT_DIR/bench-$name.txt" 2>&1 \
    || echo "bench $name failed: $(tail -n 3 "$OUT_DIR/bench-$name.txt")"
}
bench fp32-graphs --dtype float32
bench fp32-eager --dtype float32 --enforce-eager
bench bf16-graphs --dtype bfloat16
bench bf16-eager --dtype bfloat16 --enforce-eager

python - "$OUT_DIR" "$conf_rc" "$conf_s" "$DEVICE" <<'PY'
import json, os, sys
out, rc, secs, device = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = []
path = os.path.join(out, f"conformance-{device}.json")
if os.path.exists(path):
    c = json.load(open(path))["counts"]
    rows.append((f"conformance {device}", f"{c['passing']} passing, {c['failing']} failing, {c['untested']} untested "
                                     f"(exit {rc}, {secs} s)"))
else:
    rows.append((f"conformance {device}", f"no report (exit {rc}); see conformance.txt"))
for name in ("fp32-graphs", "fp32-eager", "bf16-graphs", "bf16-eager"):
    p = os.path.join(out, f"bench-{name}.json")
    if os.path.exists(p):
        b = json.load(open(p))
        rows.append((f"throughput {name}", f"{b['output_tok_s']:.0f} output tok/s, {b['total_tok_s']:.0f} total tok/s, "
                                           f"prefill {b['prefill_tok_s']:.0f} tok/s, cold start {b['cold_start_s']:.1f} s"))
    else:
        rows.append((f"throughput {name}", "failed; see bench-" + name + ".txt"))
print("\n| check | result |\n|---|---|")
for k, v in rows:
    print(f"| {k} | {v} |")
PY
exit $conf_rc
