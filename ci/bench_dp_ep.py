"""DP+EP against plain data parallel and one engine, alternated (docs/distributed.md, issue 14). Every round starts
each server alone, records its engine processes' resident memory, drives it with `pagedllm bench serve` and stops it
(SIGTERM: a DP+EP replica then logs its lock-step forwards and the time it spent in MoE exchanges, parsed here).
Ratios are medians of per-round ratios, so load from other processes hits every configuration alike.

    python ci/bench_dp_ep.py --rounds 3 --num-prompts 64 --input-len 32 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

CONFIGS = {"dp1": ["--engine-cpus", "0-1"], "dp2": ["--data-parallel-size", "2"],
           "dp2_ep": ["--data-parallel-size", "2", "--enable-expert-parallel"]}
EXCHANGE = re.compile(r"DP\+EP replica (\d+): (\d+) lock-step forwards \((\d+) dummy\).*?([\d.]+) ms per forward")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> list[float]:
    """Resident memory of every descendant of ``pid``, largest first (the engine processes lead)."""
    out = []
    try:
        kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return out
    for k in kids:
        try:
            out.append(int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{k}/status").read()).group(1)) / 1024)
        except (OSError, AttributeError):
            pass
        out += rss_mb(int(k))
    return sorted(out, reverse=True)


def run_one(model: str, name: str, bench: list[str]) -> dict:
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix=f"bench-dp-ep-{name}-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", model, "--device", "cpu", "--port",
                                 str(port), "--dtype", "float32", "--max-model-len", "256", "--served-model-name", "m",
                                 "--uvicorn-log-level", "warning", *CONFIGS[name]], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name}: server did not start:\n{open(log.name).read()[-3000:]}")
            time.sleep(0.5)
        rss = rss_mb(proc.pid)[: 1 if name == "dp1" else 2]
        js = log.name + ".json"
        subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "serve", "--base-url",
                        f"http://127.0.0.1:{port}", *bench, "--json", js], check=True, capture_output=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    r = json.load(open(js))
    text = open(log.name).read()
    os.unlink(js)
    os.unlink(log.name)
    return dict(tok_s=r["output_throughput"], ttft_ms=r["median_ttft_ms"], tpot_ms=r["median_tpot_ms"],
                failed=r["failed"], rss_mb=[round(x) for x in rss],
                exchange_ms_per_forward=[float(m[3]) for m in EXCHANGE.findall(text)])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="an MoE model folder with a tokenizer (default: build the bench "
                                                 "Mixtral of tests/support/tiny_models.py into a temporary folder)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.model is not None:
        return run(a, a.model)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support"))
    from server_utils import tiny_chat_model
    from tiny_models import make_bench_mixtral

    with tempfile.TemporaryDirectory(prefix="bench-mixtral-") as d:
        run(a, make_bench_mixtral(d, tiny_chat_model()))


def run(a: argparse.Namespace, model: str) -> None:
    bench = ["--num-prompts", str(a.num_prompts), "--input-len", str(a.input_len), "--output-len", str(a.output_len)]
    runs: dict[str, list[dict]] = {k: [] for k in CONFIGS}
    for r in range(a.rounds):
        for name in CONFIGS:
            runs[name].append(run_one(model, name, bench))
            print(r, name, runs[name][-1], flush=True)
    med = lambda k, f: statistics.median(x[f] for x in runs[k])  # noqa: E731
    for k in CONFIGS:
        print(f"{k:7s} median output tok/s {med(k, 'tok_s'):7.1f}  TTFT {med(k, 'ttft_ms'):6.0f} ms  "
              f"TPOT {med(k, 'tpot_ms'):6.1f} ms  engine RSS MiB {[x['rss_mb'] for x in runs[k]]}")
    for other in ("dp2", "dp1"):
        ratio = statistics.median(e["tok_s"] / o["tok_s"] for e, o in zip(runs["dp2_ep"], runs[other]))
        print(f"DP+EP / {other} output tok/s, median of per-round ratios: {ratio:.2f}")
    if a.json:
        json.dump(runs, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
