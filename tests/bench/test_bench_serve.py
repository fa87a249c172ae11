"""``pagedllm bench serve`` against a real server on the tiny model: the JSON holds consistent metrics."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest
from pagedllm.bench.serve import arrival_gaps, make_prompts
from server_utils import API_KEY, ServerProcess, metrics, tiny_chat_model, wait_idle
from tiny_models import make_bench_llama


def test_poisson_gaps_and_prompts():
    gaps = arrival_gaps(4000, 8.0, seed=1)
    assert statistics.mean(gaps) == pytest.approx(1 / 8.0, rel=0.08)
    assert statistics.stdev(gaps) == pytest.approx(1 / 8.0, rel=0.1)  # exponential: sd == mean
    assert arrival_gaps(5, math.inf, seed=0) == [0.0] * 5
    ps = make_prompts(3, 7, 100, 200, seed=0)
    assert [len(p) for p in ps] == [7, 7, 7] and all(100 <= t < 200 for p in ps for t in p)
    assert ps == make_prompts(3, 7, 100, 200, seed=0)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(tiny_chat_model())
    yield srv
    srv.stop()


def test_bench_serve_json(server, tmp_path):
    out = tmp_path / "bench.json"
    before = metrics(server.base_url)
    n, ilen, olen = 12, 24, 10
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", "bench", "serve", "--base-url", server.base_url, "--api-key", API_KEY,
         "--num-prompts", str(n), "--request-rate", "30", "--input-len", str(ilen), "--output-len", str(olen),
         "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TTFT" in proc.stdout and "output tok/s" in proc.stdout
    r = json.loads(out.read_text())
    assert r["model"] == "test-model"
    assert (r["completed"], r["failed"]) == (n, 0)
    assert r["total_input_tokens"] == n * ilen and r["total_output_tokens"] == n * olen
    assert r["request_throughput"] == pytest.approx(n / r["duration_s"])
    assert r["output_throughput"] == pytest.approx(n * olen / r["duration_s"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        mean, med, p99 = r[f"mean_{name}_ms"], r[f"median_{name}_ms"], r[f"p99_{name}_ms"]
        assert 0 < med <= p99 and mean > 0, name
    assert r["p99_ttft_ms"] < r["p99_e2el_ms"]
    # The server saw exactly this work (plus the benchmark's one warm-up request of min(olen, 4) tokens).
    m = wait_idle(server.base_url)
    assert m["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"] == n * olen + 4
    assert m["pagedllm:prompt_tokens_total"] - before["pagedllm:prompt_tokens_total"] == (n + 1) * ilen


def test_bench_serve_vs_offline(tmp_path):
    """``pagedllm bench serve-vs-offline``, the rerun recipe behind docs/benchmarks.md's server/offline ratios, runs
    end to end (pinned variant: offline and the engine process on one CPU set, the HTTP process and the client on
    another)."""
    model = make_bench_llama(tmp_path / "bench_llama")  # vocab 32000: bench serve's default prompt token ids fit
    cpus = sorted(os.sched_getaffinity(0))
    proc = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "serve-vs-offline", "--rounds", "1",
                           "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--model", model,
                           "--engine-args", "--device cpu --max-model-len 128", "--engine-cpus", str(cpus[0]),
                           "--frontend-cpus", str(cpus[-1])], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    m = re.fullmatch(r"round 1: offline ([\d.]+) tok/s, server ([\d.]+) tok/s, ratio ([\d.]+) \(failed=0 .*\)", lines[0])
    assert m, proc.stdout
    off, srv, ratio = map(float, m.groups())
    assert off > 0 and srv > 0 and ratio == pytest.approx(srv / off, abs=2e-3)
    assert lines[1].startswith(f"median: offline {off:.1f} tok/s, server {srv:.1f} tok/s"), proc.stdout
