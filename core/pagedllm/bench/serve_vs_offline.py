"""``pagedllm bench serve-vs-offline``: server vs offline at saturation, interleaved (docs/benchmarks.md, issue 4).

Each round runs ``pagedllm bench throughput`` (offline, ``--repeats 1``), then a fresh ``pagedllm serve`` driven by
``pagedllm bench serve --request-rate inf`` on the same workload and engine flags, and prints both output-token rates
and their ratio; the last line gives the medians. Rounds alternate so that the machine's drift hits both sides alike.

With ``--engine-cpus`` and ``--frontend-cpus`` (CPU lists, e.g. 0 and 1) the offline run runs on the engine CPUs, the
server gets ``--engine-cpus`` (its engine process there, its HTTP process on the other CPUs) and the benchmark client
runs on the front-end CPUs: a deployment with cores reserved for the front end (vLLM's CPU backend reserves them
too). This separates what the server costs from what sharing the engine's cores with HTTP and the client costs.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import tempfile

from pagedllm.bench.server_process import PAGEDLLM, ServeProcess, bench_serve
from pagedllm.errors import ParamError


def add_parser(sub) -> None:
    p = sub.add_parser("serve-vs-offline", help="server at saturation vs offline throughput, rounds interleaved")
    p.add_argument("--model", default=None, help="model for both sides (default: the embedded SmolLM2)")
    p.add_argument("--engine-args", default="", help="engine flags for both sides, one string (e.g. '--device cpu "
                                                     "--dtype float32 --max-model-len 1024')")
    p.add_argument("--serve-args", default="", help="server-only flags, one string (e.g. '--stream-interval 4')")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--engine-cpus", default=None, help="CPU list for the offline run and the server's engine process")
    p.add_argument("--frontend-cpus", default=None, help="CPU list for the benchmark client (with --engine-cpus)")
    p.set_defaults(func=main)


def offline_tok_s(model_flags: list[str], engine: list[str], workload: list[str], prefix: list[str], env: dict,
                  tmp: str) -> float:
    path = os.path.join(tmp, "off.json")
    done = subprocess.run([*prefix, *PAGEDLLM, "bench", "throughput", *model_flags, *engine, *workload, "--repeats",
                           "1", "--json", path], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"offline `pagedllm bench throughput` failed:\n{(done.stdout + done.stderr)[-2000:]}")
    with open(path) as f:
        return round(json.load(f)["output_tok_s"], 1)


def main(args) -> int:
    if bool(args.engine_cpus) != bool(args.frontend_cpus):
        raise ParamError("frontend_cpus", "give --engine-cpus and --frontend-cpus together")
    engine, serve_only = shlex.split(args.engine_args), shlex.split(args.serve_args)
    on_engine, on_frontend = [], []
    if args.engine_cpus:
        on_engine, on_frontend = ["taskset", "-c", args.engine_cpus], ["taskset", "-c", args.frontend_cpus]
        serve_only += ["--engine-cpus", args.engine_cpus]
    workload = ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
                str(args.output_len)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    offs, srvs, ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-serve-vs-offline-") as tmp:
        for r in range(1, args.rounds + 1):
            model_flags = ["--model", args.model] if args.model else []
            off = offline_tok_s(model_flags, engine, workload, on_engine, env, tmp)
            with ServeProcess(args.model, [*engine, *serve_only], os.path.join(tmp, "serve.log"), env=env) as server:
                d = bench_serve(server.base_url, workload, os.path.join(tmp, "srv.json"), on_frontend, env)
            srv = round(d["output_throughput"], 1)
            ratio = float(f"{srv / off:.3f}")
            print(f"round {r}: offline {off} tok/s, server {srv} tok/s, ratio {ratio:.3f} (failed={d['failed']} "
                  f"ttft_p50={d['median_ttft_ms']:.0f}ms tpot_p50={d['median_tpot_ms']:.1f}ms)", flush=True)
            offs.append(off)
            srvs.append(srv)
            ratios.append(ratio)
    print(f"median: offline {statistics.median(offs):.1f} tok/s, server {statistics.median(srvs):.1f} tok/s, "
          f"ratio {statistics.median(ratios):.3f} (per round: {' '.join(f'{x:.3f}' for x in ratios)})")
    return 0
