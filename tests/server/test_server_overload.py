"""Overload and deadlines against real servers on the tiny model.

* ``--max-num-queued-reqs``: past the limit a clean 429 with ``Retry-After`` (the openai client's RateLimitError),
  reserved before any rendering; slots come back when responses end.
* ``--request-timeout``: a request past its deadline is aborted (408, or an error event mid-stream) and its KV blocks
  are freed.
* 512 concurrent streaming clients (official openai client, asyncio): only successes and clean 429s, the engine back
  to 0 running / 0 waiting / 0 used blocks, and the HTTP process's RSS bounded (printed).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from server_utils import ServerProcess, metrics, rss_kb, tiny_chat_model, wait_idle

USER = [{"role": "user", "content": "Hi"}]
LIMIT = 8
DEADLINE = 2.0


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(tiny_chat_model(), "--max-model-len", "512", "--max-num-seqs", "1", "--max-num-queued-reqs",
                        str(LIMIT), "--request-timeout", str(DEADLINE), api_key=None)
    yield srv
    srv.stop()


def _idle(srv: ServerProcess) -> None:
    m = wait_idle(srv.base_url)
    assert (m["pagedllm:num_requests_running"], m["pagedllm:num_requests_waiting"],
            m["pagedllm:kv_cache_used_blocks"]) == (0, 0, 0), m


def test_429_with_retry_after_then_deadline_frees_blocks(server):
    """n=8 fills the admission limit; the next request is a 429; the stream ends at its deadline with an error
    event, and its blocks are freed (8 x 500 tokens, one sequence a step: 4,000 steps cannot finish in 2 s)."""
    events: list[str] = []
    first = threading.Event()
    done: dict = {}

    def stream() -> None:
        t = time.monotonic()
        body = {"prompt": "Once upon a time", "n": LIMIT, "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url_v1}/completions", json=body, timeout=30) as r:
            done["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
        done["took"] = time.monotonic() - t

    th = threading.Thread(target=stream)
    th.start()
    assert first.wait(30)
    client = openai.OpenAI(base_url=server.url_v1, api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="test-model", messages=USER, max_tokens=2)
    assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
    assert e.value.code == "too_many_requests"
    th.join(30)
    assert done["status"] == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "request_timeout", err
    assert DEADLINE <= done["took"] < DEADLINE + 1.0, done
    _idle(server)
    assert metrics(server.base_url)["pagedllm:request_rejected_total"] >= 1
    r = client.chat.completions.create(model="test-model", messages=USER, max_tokens=2)  # slots came back
    assert r.choices[0].finish_reason == "length"


def test_non_streaming_deadline_is_408(server):
    t = time.monotonic()
    r = httpx.post(f"{server.url_v1}/completions", timeout=30,
                   json={"prompt": "Once upon a time", "n": 4, "max_tokens": 500, "ignore_eos": True})
    took = time.monotonic() - t
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text
    assert took < DEADLINE + 1.0
    _idle(server)


def test_admission_counts_batched_prompts(server):
    r = httpx.post(f"{server.url_v1}/completions", json={"prompt": ["a"] * 3, "n": 3, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # 9 sequences > 8: can never be admitted
    _idle(server)


N_CLIENTS = 512
BIG_LIMIT = 384


def test_512_concurrent_streaming_clients():
    srv = ServerProcess(tiny_chat_model(), "--max-model-len", "256", "--max-num-queued-reqs", str(BIG_LIMIT),
                        api_key=None)
    try:
        rss_before = rss_kb(srv.proc.pid)

        async def run() -> list:
            client = openai.AsyncOpenAI(base_url=srv.url_v1, api_key="none", max_retries=0, timeout=120)

            async def one(i: int):
                try:
                    stream = await client.chat.completions.create(
                        model="test-model", messages=[{"role": "user", "content": f"Hello {i}"}], max_tokens=8,
                        stream=True, extra_body={"ignore_eos": True})
                    n = 0
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            n += 1
                    return ("ok", n)
                except openai.RateLimitError as e:
                    return ("429", e.response.headers.get("retry-after"))
                except Exception as e:  # noqa: BLE001 - counted and shown
                    return ("error", repr(e))

            try:
                return await asyncio.gather(*(one(i) for i in range(N_CLIENTS)))
            finally:
                await client.close()

        t = time.monotonic()
        results = asyncio.run(run())
        took = time.monotonic() - t
        ok = [r for r in results if r[0] == "ok"]
        limited = [r for r in results if r[0] == "429"]
        errors = [r for r in results if r[0] == "error"]
        m = wait_idle(srv.base_url)
        rss_after, rss_peak = rss_kb(srv.proc.pid), rss_kb(srv.proc.pid, "VmHWM")
        print(f"{N_CLIENTS} clients in {took:.1f} s: {len(ok)} ok, {len(limited)} clean 429s, {len(errors)} errors; "
              f"HTTP process RSS {rss_before / 1024:.0f} MiB before, {rss_after / 1024:.0f} MiB after, peak "
              f"{rss_peak / 1024:.0f} MiB")
        assert not errors, errors[:5]
        assert len(ok) >= BIG_LIMIT and all(n >= 1 for _, n in ok)  # a refusal means the limit was full
        assert all(ra == "1" for _, ra in limited)
        assert (m["pagedllm:num_requests_running"], m["pagedllm:num_requests_waiting"],
                m["pagedllm:kv_cache_used_blocks"]) == (0, 0, 0), m
        assert rss_peak - rss_before < 256 * 1024, (rss_before, rss_peak)  # < 256 MiB for 512 open streams
        assert "Traceback" not in srv.output()
    finally:
        srv.stop()
