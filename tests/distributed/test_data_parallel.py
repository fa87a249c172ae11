"""Data parallel (``pagedllm serve --data-parallel-size 2``) against a real server process on the tiny model.

* 64 concurrent greedy streams through the official openai client: no errors, every output equal to one engine's
  (the offline LLM, i.e. DP=1) for the same prompt, and both replicas served requests (per-engine /metrics).
* A client disconnect aborts the request in whichever replica holds it (every replica's KV blocks freed).
* SIGKILL of one replica mid-generation: its streams end with an error, the other replica's finish, /health turns
  503, new requests get 503, and nothing hangs (hard timeouts).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from server_utils import ServerProcess, cmdline, descendants, gone, tiny_chat_model, wait_for_grammar_zygote

from pagedllm.engine.dp_client import split_cpus
from pagedllm.engine.prefix_router import least_loaded
from pagedllm.errors import ParamError

MAX_LEN = 512
N_STREAMS = 64
PROMPTS = [[100 + (7 * i + 13 * j) % 900 for j in range(3 + i % 11)] for i in range(N_STREAMS)]


def per_engine(base_url: str, name: str) -> dict[str, float]:
    """One sample of ``/metrics`` per ``engine`` label value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name:
                out[s.labels["engine"]] = s.value
    return out


def wait_all_idle(base_url: str, timeout: float = 20.0) -> dict[str, dict[str, float]]:
    """Poll until no engine runs or queues a request or holds a KV block (aborts land asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = {n: per_engine(base_url, f"pagedllm:{n}") for n in ("num_requests_running", "num_requests_waiting",
                                                                   "kv_cache_used_blocks")}
        if all(v == 0 for d in busy.values() for v in d.values()) or time.monotonic() > deadline:
            return busy
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(tiny_chat_model(), "--data-parallel-size", "2", "--max-model-len", str(MAX_LEN),
                        "--no-exit-on-engine-failure", api_key=None)
    yield srv
    srv.stop()


def test_least_loaded_ties_round_robin():
    assert least_loaded([3, 1, 2], 0) == 1
    assert [least_loaded([0, 0, 0], s) for s in range(3)] == [0, 1, 2]
    assert least_loaded([1, 0, 0], 2) == 2 and least_loaded([1, 0, 0], 0) == 1
    assert split_cpus([3, 0, 1, 2, 4], 2) == [frozenset({0, 1, 2}), frozenset({3, 4})]
    with pytest.raises(ParamError, match="data_parallel_size"):
        split_cpus([0], 2)


def test_offline_llm_refuses_data_parallel():
    from pagedllm import LLM

    with pytest.raises(ParamError, match="data_parallel_size"):
        LLM(tiny_chat_model(), device="cpu", data_parallel_size=2)


def test_64_streams_spread_and_equal_to_one_engine(server):
    from pagedllm import LLM, SamplingParams

    llm = LLM(tiny_chat_model(), device="cpu", max_model_len=MAX_LEN)
    ref = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                                    use_tqdm=False)]
    del llm
    before = per_engine(server.base_url, "pagedllm:engine_requests_total")

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        stream = await client.completions.create(model=server.served_name, prompt=PROMPTS[i], max_tokens=16,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url_v1, api_key="none", max_retries=0, timeout=120,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=100))) as client:
            return await asyncio.gather(*(one(client, i) for i in range(N_STREAMS)), return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert [f for _, f in results] == ["length"] * N_STREAMS
    assert [t for t, _ in results] == ref
    after = per_engine(server.base_url, "pagedllm:engine_requests_total")
    served = {e: after[e] - before.get(e, 0) for e in after}
    print("requests per engine:", served)
    assert sorted(served) == ["0", "1"] and sum(served.values()) == N_STREAMS
    assert min(served.values()) >= N_STREAMS // 4, served  # least-loaded dispatch spreads a burst
    tokens = per_engine(server.base_url, "pagedllm:generation_tokens_total")
    assert all(tokens[e] >= 16 * served[e] for e in served), tokens
    busy = wait_all_idle(server.base_url)
    assert all(v == 0 for d in busy.values() for v in d.values()), busy


def test_disconnects_abort_in_their_replica(server):
    body = {"model": server.served_name, "prompt": PROMPTS[0], "max_tokens": 400, "stream": True,
            "ignore_eos": True}

    def one() -> None:
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.url_v1}/completions", json=body) as r:
            assert r.status_code == 200
            for n, line in enumerate(l for l in r.iter_lines() if l.startswith("data: {")):
                if n == 2:
                    return  # closes the connection mid-stream

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    busy = wait_all_idle(server.base_url)
    assert all(v == 0 for d in busy.values() for v in d.values()), busy
    assert httpx.get(f"{server.base_url}/health").status_code == 200


@pytest.mark.timeout(180)
def test_killed_replica_fails_its_requests_and_health_503(server):
    """Runs last in this module: it kills engine 0."""
    pids = {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"data parallel: engine (\d) is process (\d+)",
                                                                  server.output())}
    assert sorted(pids) == [0, 1], server.output()
    n = 8
    started = threading.Barrier(n + 1)
    ends: list[tuple[str, float]] = []
    body = {"model": server.served_name, "prompt": PROMPTS[1], "max_tokens": MAX_LEN - 16, "stream": True,
            "ignore_eos": True}

    def one() -> None:
        outcome = "hung"
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.url_v1}/completions", json=body) as r:
            first = True
            try:
                for line in r.iter_lines():
                    if first and line.startswith("data: {"):
                        first = False
                        started.wait(60)
                    if '"error"' in line:
                        outcome = "error"
                    elif '"finish_reason":"length"' in line.replace(" ", ""):
                        outcome = "length"
            except httpx.HTTPError as e:
                outcome = f"transport: {e!r}"
        ends.append((outcome, time.monotonic()))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    started.wait(60)
    running = per_engine(server.base_url, "pagedllm:num_requests_running")
    killed = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(60)
    outcomes = sorted(o for o, _ in ends)
    print(f"running per engine at the kill: {running}; outcomes: {outcomes}")
    assert len(ends) == n, "a stream hung"
    assert set(outcomes) <= {"error", "length"}, outcomes
    assert outcomes.count("error") >= 1 and outcomes.count("length") >= 1, outcomes
    assert max(t for o, t in ends if o == "error") - killed < 5.0
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.base_url}/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = httpx.get(f"{server.base_url}/health")
    assert r.status_code == 503 and "data-parallel engine 0" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url_v1}/completions", json={"model": server.served_name, "prompt": "x",
                                                         "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
    assert per_engine(server.base_url, "pagedllm:num_requests_running")["1"] == 0  # the survivor finished its own
    assert server.proc.poll() is None


def test_cli_rejects_bad_data_parallel_size():
    r = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--data-parallel-size", "0", "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "data_parallel_size" in r.stderr + r.stdout


@pytest.mark.timeout(180)
def test_replica_death_exits_server_by_default():
    """--exit-on-engine-failure (the default): one replica's death ends every in-flight stream with its error (on
    either replica), the server exits non-zero within 5 s, and no process is left behind."""
    srv = ServerProcess(tiny_chat_model(), "-dp", "2", "--max-model-len", str(MAX_LEN), api_key=None)
    try:
        wait_for_grammar_zygote(srv.proc.pid)  # (started after /health: its processes must go too)
        procs = descendants(srv.proc.pid)
        engines = [p for p in procs if "spawn_main" in cmdline(p)]
        assert len(engines) == 2, [cmdline(p) for p in procs]
        body = {"model": srv.served_name, "prompt": PROMPTS[2], "max_tokens": MAX_LEN - 16, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{srv.url_v1}/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(l for l in lines if l.startswith("data: {"))
            killed = time.monotonic()
            os.kill(engines[0], signal.SIGKILL)
            rest = list(lines)  # whichever engine held it, the stream ends with the dead engine's error
        took = time.monotonic() - killed
        assert any('"error"' in l and "exited unexpectedly (exit code -9)" in l for l in rest), rest[-3:]
        code = srv.wait(10)
        exited = time.monotonic() - killed
        print(f"stream ended {took:.2f} s after the kill; server exited after {exited:.2f} s with code {code}")
        assert code != 0 and exited < 5.0
        assert all(gone(p, 10) for p in procs), [cmdline(p) for p in procs if not gone(p, 0)]
    finally:
        srv.stop()
