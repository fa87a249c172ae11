"""``pagedllm bench prefix-routing``: cache-aware vs least-loaded data-parallel routing on a multi-tenant
shared-prefix workload (docs/distributed.md, issue 31).

Every round starts ``pagedllm serve MODEL --data-parallel-size N --dp-routing MODE`` for each mode alone (the two
alternated, the first mode swapped every round), drives it with ``pagedllm bench serve`` and its
``--prefix-repetition-*`` workload, and stops it. Reported per mode: the replicas' prefix-cache hit rate over the
run (their own counters, summed), TTFT p50 / p99, output throughput, and the router's decisions; medians over rounds.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import tempfile
from typing import Callable

from pagedllm.bench.server_process import ServeProcess, bench_serve
from pagedllm.engine.prefix_router import ROUTING_POLICIES

SERVE_DEFAULT = "--device cpu --max-model-len 1024"


def add_parser(sub) -> None:
    p = sub.add_parser("prefix-routing", help="cache-aware vs least-loaded data-parallel routing on a multi-tenant "
                                              "shared-prefix workload: servers alternated per round")
    p.add_argument("--model", default=None, help="model to serve (default: `pagedllm serve`'s, the embedded SmolLM2)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=2)
    p.add_argument("--serve-args", default=SERVE_DEFAULT,
                   help=f"more `pagedllm serve` flags, one string (default {SERVE_DEFAULT!r}); e.g. --kv-cache-memory "
                        "so that a replica's pool holds only part of the tenants' prefixes")
    add_workload_args(p)
    p.set_defaults(func=main)


def add_workload_args(p) -> None:
    """The multi-tenant shared-prefix workload's flags (also ``bench router-routing``'s)."""
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--num-prefixes", type=int, default=8, help="tenants, each with its own shared prefix")
    p.add_argument("--prefix-len", type=int, default=512, help="tokens of each tenant's shared prefix")
    p.add_argument("--input-len", type=int, default=32, help="tokens of each prompt after its tenant's prefix")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default: inf)")
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--json", default=None, help="write every round's results as JSON here")


def workload_args(args) -> list[str]:
    """``pagedllm bench serve`` flags of the workload."""
    bench = ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
             str(args.output_len), "--request-rate", str(args.request_rate),
             "--prefix-repetition-num-prefixes", str(args.num_prefixes),
             "--prefix-repetition-prefix-len", str(args.prefix_len)]
    if args.max_concurrency:
        bench += ["--max-concurrency", str(args.max_concurrency)]
    return bench


def run_one(args, mode: str) -> dict:
    """Start the ``mode`` server alone, benchmark it, stop it."""
    fd, log = tempfile.mkstemp(prefix=f"bench-prefix-routing-{mode}-", suffix=".log")
    os.close(fd)
    serve = ["--served-model-name", "m", "--data-parallel-size", str(args.data_parallel_size), "--dp-routing", mode,
             *shlex.split(args.serve_args)]
    server = ServeProcess(args.model, serve, log, timeout=600)
    try:
        r = bench_serve(server.base_url, workload_args(args), log + ".json")
    finally:
        server.stop()
    os.unlink(log)
    return dict(hit_rate=r["prefix_cache_hit_rate"], ttft_p50_ms=r["median_ttft_ms"], ttft_p99_ms=r["p99_ttft_ms"],
                tok_s=r["output_throughput"], failed=r["failed"], routing=r["dp_routing_decisions"])


def main(args) -> int:
    return alternate(args, run_one, f"DP={args.data_parallel_size}")


def alternate(args, run_one: Callable[[object, str], dict], what: str) -> int:
    """``run_one(args, mode)`` for each routing mode, alternated ``args.rounds`` times (the first mode swapped
    every round); prints the medians per mode and the TTFT ratio."""
    modes = list(ROUTING_POLICIES)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for i in range(args.rounds):
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            runs[mode].append(run_one(args, mode))
            print(i, mode, runs[mode][-1], flush=True)
    print(f"{what}, {args.num_prompts} prompts: {args.num_prefixes} tenants x "
          f"{args.prefix_len}-token prefix + {args.input_len} own tokens -> {args.output_len}; "
          f"medians of {args.rounds} rounds")
    for m in modes:
        med = lambda f: statistics.median(x[f] for x in runs[m])  # noqa: E731
        print(f"{m:13s} prefix hit rate {100 * med('hit_rate'):5.1f}%  TTFT p50 {med('ttft_p50_ms'):8.1f} ms  "
              f"p99 {med('ttft_p99_ms'):8.1f} ms  output {med('tok_s'):7.1f} tok/s  failed "
              f"{sum(x['failed'] for x in runs[m])}")
    a, b = runs["cache_aware"], runs["least_loaded"]
    ratio = statistics.median(y["ttft_p50_ms"] / x["ttft_p50_ms"] for x, y in zip(a, b) if x["ttft_p50_ms"])
    print(f"TTFT p50 least_loaded / cache_aware, median of per-round ratios: {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0 if all(x["failed"] == 0 for m in modes for x in runs[m]) else 1
