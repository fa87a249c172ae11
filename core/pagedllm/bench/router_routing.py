"""``pagedllm bench router-routing``: cache-aware vs least-loaded ``pagedllm router`` over separate ``pagedllm serve``
replicas, on ``bench prefix-routing``'s multi-tenant shared-prefix workload (docs/kv-offload.md, issue 31).

Every run starts ``--replicas`` fresh servers (fresh prefix caches) and ``pagedllm router --backend ... --routing
MODE`` in front, drives the router with ``pagedllm bench serve``, and stops them all; the two modes alternate, the
first swapped every round. Reported per mode: the replicas' prefix-cache hit rate over the run (their own counters,
which the router's /metrics relays per backend), TTFT p50 / p99, output throughput, and the router's decisions;
medians over rounds.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from pagedllm.bench.prefix_routing import add_workload_args, alternate, workload_args
from pagedllm.bench.server_process import PAGEDLLM, ServeProcess, bench_serve

SERVE_DEFAULT = "--device cpu --max-model-len 1024"


def add_parser(sub) -> None:
    p = sub.add_parser("router-routing", help="cache-aware vs least-loaded `pagedllm router` over separate serve "
                                              "replicas on a multi-tenant shared-prefix workload, alternated")
    p.add_argument("--model", default=None, help="model to serve (default: `pagedllm serve`'s, the embedded SmolLM2)")
    p.add_argument("--replicas", type=int, default=2, help="`pagedllm serve` processes behind the router")
    p.add_argument("--block-size", type=int, default=16, help="the replicas' --block-size, which the router mirrors")
    p.add_argument("--serve-args", default=SERVE_DEFAULT,
                   help=f"more `pagedllm serve` flags for every replica, one string (default {SERVE_DEFAULT!r}); "
                        "e.g. --kv-cache-memory so that a replica's pool holds only part of the tenants' prefixes")
    p.add_argument("--router-args", default="", help="more `pagedllm router` flags, one string "
                                                     "(e.g. --balance-abs-threshold 8)")
    add_workload_args(p)
    p.set_defaults(func=main)


class RouterProcess:
    """``pagedllm router`` on a free loopback port, ready (``/health`` 200) on return, or stopped with its log."""

    def __init__(self, args, log_path: str, timeout: float = 120.0):
        from pagedllm.executor.base import free_port  # heavy: torch, not at CLI start

        self.base_url = f"http://127.0.0.1:{free_port()}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([*PAGEDLLM, "router", "--port", self.base_url.rsplit(":", 1)[1], *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                with open(log_path, errors="replace") as f:
                    raise RuntimeError(f"`pagedllm router` did not come up (log {log_path}):\n{f.read()[-2000:]}")
            time.sleep(0.2)

    def decisions(self) -> dict[str, int]:
        """The router's decisions so far, summed over backends: {decision: requests}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, int] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "pagedllm:router_routing_decisions_total":
                    out[s.labels["decision"]] = out.get(s.labels["decision"], 0) + int(s.value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_one(args, mode: str) -> dict:
    """Fresh replicas and a ``mode`` router in front; benchmark through the router; stop everything."""
    logs = []

    def log(name: str) -> str:
        fd, path = tempfile.mkstemp(prefix=f"bench-router-routing-{mode}-{name}-", suffix=".log")
        os.close(fd)
        logs.append(path)
        return path

    serve = ["--served-model-name", "m", "--block-size", str(args.block_size), *shlex.split(args.serve_args)]
    with ThreadPoolExecutor(args.replicas) as pool:
        futures = [pool.submit(ServeProcess, args.model, serve, log(f"serve{i}"), 600) for i in range(args.replicas)]
    replicas = [f.result() for f in futures if f.exception() is None]
    router = None
    try:
        if len(replicas) < args.replicas:
            raise next(f.exception() for f in futures if f.exception() is not None)
        router = RouterProcess([a for r in replicas for a in ("--backend", r.base_url)]
                               + ["--routing", mode, "--block-size", str(args.block_size),
                                  *shlex.split(args.router_args)], log("router"))
        r = bench_serve(router.base_url, workload_args(args), logs[-1] + ".json")
        decisions = router.decisions()
    finally:
        if router is not None:
            router.stop()
        for s in replicas:
            s.stop()
    for path in logs:
        os.unlink(path)
    return dict(hit_rate=r["prefix_cache_hit_rate"], ttft_p50_ms=r["median_ttft_ms"], ttft_p99_ms=r["p99_ttft_ms"],
                tok_s=r["output_throughput"], failed=r["failed"], routing=decisions)


def main(args) -> int:
    return alternate(args, run_one, f"router over {args.replicas} replicas")
