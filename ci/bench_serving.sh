#!/usr/bin/env bash
# Server vs offline at saturation, interleaved: each round runs `pagedllm bench throughput` (offline, --repeats 1),
# then a fresh `pagedllm serve` driven by `pagedllm bench serve --request-rate inf` on the same workload and engine
# flags, and prints both output-token rates and their ratio; the last line gives the medians. Rounds alternate so
# that the machine's drift hits both sides alike.
#
# With ENGINE_CPUS and FRONTEND_CPUS set (CPU lists, e.g. 0 and 1), the offline run runs on ENGINE_CPUS, the server
# gets `--engine-cpus ENGINE_CPUS` (its engine process there, its HTTP process on the other CPUs) and the benchmark
# client runs on FRONTEND_CPUS: a deployment with cores reserved for the front end (vLLM's CPU backend reserves them
# too). This separates what the server costs from what sharing the engine's cores with HTTP and the client costs.
#
# usage: ci/bench_serving.sh ROUNDS NUM_PROMPTS INPUT_LEN OUTPUT_LEN [ENGINE FLAGS...] [-- SERVE-ONLY FLAGS...]
#   e.g. ci/bench_serving.sh 5 128 32 64 --device cpu --dtype float32 --max-model-len 1024
#        ci/bench_serving.sh 5 256 32 128 --model /tmp/bench_llama --device cpu -- --stream-interval 4
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=$1 n=$2 in=$3 out=$4
shift 4
engine=() serve_only=()
while (($#)); do
  if [[ $1 == -- ]]; then shift; serve_only=("$@"); break; fi
  engine+=("$1"); shift
done
model=() flags=()  # `serve` takes the model positionally
for ((i = 0; i < ${#engine[@]}; i++)); do
  if [[ ${engine[i]} == --model ]]; then model=("${engine[i + 1]}"); i=$((i + 1)); else flags+=("${engine[i]}"); fi
done
py=${PYTHON:-.venv/bin/python}  # the venv ci/setup.sh makes
pagedllm=("$py" -m pagedllm.cli)
on_engine=() on_frontend=()
if [[ -n ${ENGINE_CPUS:-} ]]; then
  on_engine=(taskset -c "$ENGINE_CPUS") on_frontend=(taskset -c "${FRONTEND_CPUS:?set FRONTEND_CPUS too}")
  serve_only+=(--engine-cpus "$ENGINE_CPUS")
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
tmp=$(mktemp -d)
pid=
trap '[[ -n $pid ]] && kill -TERM $pid 2>/dev/null; rm -rf "$tmp"' EXIT  # a failed round leaves no server behind
port=$($py -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
ratios=() offs=() srvs=()
for ((r = 1; r <= rounds; r++)); do
  "${on_engine[@]}" "${pagedllm[@]}" bench throughput "${engine[@]}" --num-prompts "$n" --input-len "$in" \
    --output-len "$out" --repeats 1 --json "$tmp/off.json" >"$tmp/off.log" 2>&1 || { cat "$tmp/off.log"; exit 1; }
  off=$($py -c "import json; print(round(json.load(open('$tmp/off.json'))['output_tok_s'], 1))")
  "${pagedllm[@]}" serve "${model[@]}" "${flags[@]}" "${serve_only[@]}" --port "$port" \
    --uvicorn-log-level warning >"$tmp/serve.log" 2>&1 &
  pid=$!
  until $py -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; do
    kill -0 $pid 2>/dev/null || { cat "$tmp/serve.log"; exit 1; }
    sleep 0.5
  done
  "${on_frontend[@]}" "${pagedllm[@]}" bench serve --base-url "http://127.0.0.1:$port" --num-prompts "$n" \
    --input-len "$in" --output-len "$out" --json "$tmp/srv.json" >/dev/null
  kill -TERM $pid && wait $pid || true
  pid=
  read -r srv line < <($py -c "
import json; d = json.load(open('$tmp/srv.json'))
print(round(d['output_throughput'], 1), f\"failed={d['failed']} ttft_p50={d['median_ttft_ms']:.0f}ms tpot_p50={d['median_tpot_ms']:.1f}ms\")")
  ratio=$($py -c "print(f'{$srv / $off:.3f}')")
  echo "round $r: offline $off tok/s, server $srv tok/s, ratio $ratio ($line)"
  ratios+=("$ratio") offs+=("$off") srvs+=("$srv")
done
$py - "${offs[*]}" "${srvs[*]}" "${ratios[*]}" <<'EOF'
import statistics, sys
off, srv, ratio = ([float(x) for x in a.split()] for a in sys.argv[1:])
print(f"median: offline {statistics.median(off):.1f} tok/s, server {statistics.median(srv):.1f} tok/s, "
      f"ratio {statistics.median(ratio):.3f} (per round: {' '.join(f'{x:.3f}' for x in ratio)})")
EOF
