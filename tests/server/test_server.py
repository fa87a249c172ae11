"""The real ``pagedllm serve`` process driven by the official ``openai`` client.

Oracle: the offline ``pagedllm.LLM`` on the same tiny model (greedy text, token ids and logprobs must match), plus
the tokenizer for usage counts. Concurrency and disconnect tests check /metrics: nothing running or waiting and no
KV block held afterwards.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from server_utils import API_KEY, ServerProcess, children, cmdline, gone, metrics, tiny_chat_model, wait_idle

from pagedllm import SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def model_path() -> str:
    return tiny_chat_model()


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServerProcess(model_path, "--trust-request-chat-template")  # test_request_chat_template sends one
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url_v1, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model_path):
    from pagedllm import LLM

    return LLM(model_path, device="cpu")


def test_health_version_models(server, client):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    import pagedllm

    assert httpx.get(f"{server.base_url}/version", headers=server.headers()).json() == {
        "version": pagedllm.__version__}
    models = client.models.list().data
    assert [m.id for m in models] == ["test-model"]


def test_greedy_completions_match_offline(client, offline):
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=20, logprobs=2)
    want = offline.generate(PROMPTS, sp, use_tqdm=False)
    for prompt, w in zip(PROMPTS, want):
        r = client.completions.create(model="test-model", prompt=prompt, max_tokens=20, temperature=0, logprobs=2)
        ch = r.choices[0]
        assert ch.text == w.outputs[0].text
        assert ch.finish_reason == w.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(w.prompt_token_ids)
        assert r.usage.completion_tokens == len(w.outputs[0].token_ids)
        got_lp = ch.logprobs.token_logprobs
        want_lp = [d[t].logprob for d, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)]
        assert got_lp == pytest.approx(want_lp, abs=1e-4)
        for top, lp in zip(ch.logprobs.top_logprobs, got_lp):
            assert len(top) <= 2 and max(top.values()) == pytest.approx(lp, abs=1e-6)  # greedy: the top token


def test_greedy_chat_matches_offline_and_stream(client, offline):
    from pagedllm import SamplingParams

    w = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    r = client.chat.completions.create(model="test-model", messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == w.outputs[0].text
    assert r.usage.prompt_tokens == len(w.prompt_token_ids)
    assert r.usage.completion_tokens == len(w.outputs[0].token_ids)
    stream = client.chat.completions.create(model="test-model", messages=CHAT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert roles == ["assistant"]
    assert "".join(parts) == r.choices[0].message.content
    assert finish == r.choices[0].finish_reason
    assert usage.prompt_tokens == r.usage.prompt_tokens and usage.completion_tokens == r.usage.completion_tokens


def test_completion_stream_matches_and_token_prompt(client, offline):
    from pagedllm import SamplingParams

    ids = [9690, 198, 2683, 359, 260]
    want = offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=16),
                            use_tqdm=False)[0].outputs[0]
    extra = {"return_token_ids": True}
    full = client.completions.create(model="test-model", prompt=ids, max_tokens=16, temperature=0, extra_body=extra)
    assert full.choices[0].text == want.text
    assert full.choices[0].model_extra["token_ids"] == want.token_ids
    assert full.usage.prompt_tokens == len(ids)
    text, tokens = "", []
    for c in client.completions.create(model="test-model", prompt=ids, max_tokens=16, temperature=0, stream=True,
                                       extra_body=extra):
        text += c.choices[0].text
        tokens += c.choices[0].model_extra.get("token_ids", [])
    assert text == want.text and tokens == want.token_ids


def test_echo(client):
    plain = client.completions.create(model="test-model", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    echoed = client.completions.create(model="test-model", prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="test-model", prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True, stream=True))
    assert streamed == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(client, offline):
    """lm-eval-style scoring: echo + logprobs returns the prompt tokens' logprobs (first is null), then the output."""
    r = client.completions.create(model="test-model", prompt=PROMPTS[1], max_tokens=1, temperature=0, echo=True,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    want = offline.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, logprobs=2),
                            use_tqdm=False)[0]
    ids = want.prompt_token_ids
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(want.prompt_logprobs[i][ids[i]].logprob, abs=1e-5)
        assert len(lp.top_logprobs[i]) == 2
    assert lp.token_logprobs[-1] == pytest.approx(
        want.outputs[0].logprobs[0][want.outputs[0].token_ids[0]].logprob, abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_streamed_echo_with_logprobs_equals_non_streamed(client):
    """Streaming echo + logprobs: the first chunk carries the prompt and its logprobs; all chunks concatenate to the
    non-streamed choice (text, tokens, logprobs, top logprobs and text offsets)."""
    kw = dict(model="test-model", prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True, logprobs=2)
    full = client.completions.create(**kw).choices[0]
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None:
                for key in lp:
                    lp[key] += getattr(ch.logprobs, key)
    assert text == full.text
    assert lp["tokens"] == full.logprobs.tokens and lp["text_offset"] == full.logprobs.text_offset
    assert lp["token_logprobs"][0] is None and full.logprobs.token_logprobs[0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=1e-6)
    assert [t and sorted(t) for t in lp["top_logprobs"]] == [t and sorted(t) for t in full.logprobs.top_logprobs]


def test_null_optional_fields_accepted(server):
    """Some clients send every optional field, as null: that means the default, not a 400."""
    nulls = {k: None for k in ("n", "stop", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                               "stream", "stream_options", "user", "logprobs")}
    r = httpx.post(f"{server.url_v1}/completions", headers=server.headers(), timeout=30,
                   json={**nulls, "model": "test-model", "prompt": "Hi", "max_tokens": 3, "echo": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] <= 3
    r = httpx.post(f"{server.url_v1}/chat/completions", headers=server.headers(), timeout=30,
                   json={**nulls, "model": "test-model", "messages": CHAT, "max_tokens": 3, "top_logprobs": None,
                         "max_completion_tokens": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None


def test_request_chat_template(client, offline):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    r = client.chat.completions.create(model="test-model", messages=CHAT, max_tokens=2,
                                       extra_body={"chat_template": template})
    rendered = "".join(f"<{m['role']}>{m['content']}" for m in CHAT)
    assert r.usage.prompt_tokens == len(offline.get_tokenizer().encode(rendered, add_special_tokens=False))


def test_n2_and_seed(client):
    kw = dict(model="test-model", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, n=2, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.choices[0].text != a.choices[1].text  # the n samples differ
    assert a.usage.completion_tokens == 24
    chat = client.chat.completions.create(model="test-model", messages=CHAT, max_tokens=8, temperature=1.0, n=2,
                                          stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True})
    texts, usage = {0: "", 1: ""}, None
    for chunk in chat:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(texts.values()) and usage.completion_tokens == 16


def test_chat_logprobs(client, offline):
    from pagedllm import SamplingParams

    w = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)[0].outputs[0]
    r = client.chat.completions.create(model="test-model", messages=CHAT, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(w.token_ids)
    for item, tid, d in zip(content, w.token_ids, w.logprobs):
        assert item.logprob == pytest.approx(d[tid].logprob, abs=1e-4)
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)
        assert all(x.logprob <= item.logprob + 1e-6 for x in item.top_logprobs)
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token


def test_stop_strings(client):
    base = client.completions.create(model="test-model", prompt=PROMPTS[1], max_tokens=32, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    mid = len(base) // 2
    stop = base[mid:mid + 3]
    assert stop.strip(), f"pick a visible stop string from {base!r}"
    want = base[:base.find(stop)]
    r = client.completions.create(model="test-model", prompt=PROMPTS[1], max_tokens=32, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="test-model", prompt=PROMPTS[1], max_tokens=32, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == want


def test_usage_counts(server, client, offline):
    tok = offline.get_tokenizer()
    r = client.completions.create(model="test-model", prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(tok.encode(PROMPTS[2]))
    assert r.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10
    t = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPTS[2]}, headers=server.headers()).json()
    assert t["tokens"] == tok.encode(PROMPTS[2]) and t["count"] == len(t["tokens"])
    d = httpx.post(f"{server.base_url}/detokenize", json={"tokens": t["tokens"]}, headers=server.headers()).json()
    assert d["prompt"] == PROMPTS[2]


def _idle_and_free(base_url: str) -> dict:
    m = wait_idle(base_url)
    assert m["pagedllm:num_requests_running"] == 0
    assert m["pagedllm:num_requests_waiting"] == 0
    assert m["pagedllm:kv_cache_used_blocks"] == 0
    assert m["pagedllm:kv_cache_usage_perc"] == 0
    return m


def test_64_concurrent_streams(server):
    before = metrics(server.base_url)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=16,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        finish, n = None, 0
        async for chunk in stream:
            for c in chunk.choices:
                finish = c.finish_reason or finish
            if chunk.usage:
                n = chunk.usage.completion_tokens
        return finish, n

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with openai.AsyncOpenAI(base_url=server.url_v1, api_key=API_KEY, max_retries=0, timeout=120,
                                      http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)), return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(r == ("length", 16) for r in results)
    m = _idle_and_free(server.base_url)
    assert m["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"] >= 64 * 16
    assert m["pagedllm:time_to_first_token_seconds_count"] - before["pagedllm:time_to_first_token_seconds_count"] \
        >= 64
    assert m["pagedllm:request_success_total"] - before["pagedllm:request_success_total"] >= 64


def test_16_disconnects_free_blocks(server):
    before = metrics(server.base_url)
    body = {"model": "test-model", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    errors, got = [], []

    def one() -> None:
        try:
            with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.url_v1}/completions", json=body,
                                                         headers=server.headers()) as r:
                assert r.status_code == 200
                n = 0
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        n += 1
                        if n == 3:
                            got.append(n)
                            return  # leaving the with-blocks closes the connection mid-stream
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(got) == 16
    m = _idle_and_free(server.base_url)
    assert m["pagedllm:request_aborted_total"] - before["pagedllm:request_aborted_total"] == 16
    # Aborted, not run to completion: far fewer than 16 x 400 tokens were generated.
    assert m["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"] < 16 * 400 / 2
    # And the server still serves.
    r = httpx.post(f"{server.url_v1}/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers=server.headers(), timeout=30)
    assert r.status_code == 200


def test_non_streaming_disconnect_aborts(server):
    before = metrics(server.base_url)
    body = {"model": "test-model", "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url_v1}/completions", json=body, headers=server.headers(), timeout=0.3)
    m = _idle_and_free(server.base_url)
    assert m["pagedllm:request_aborted_total"] - before["pagedllm:request_aborted_total"] == 1
    assert m["pagedllm:request_success_total"] == before["pagedllm:request_success_total"]


def test_sigterm_drains_inflight_request(model_path):
    srv = ServerProcess(model_path, api_key=None)
    try:
        result: dict = {}

        def consume() -> None:
            c = openai.OpenAI(base_url=srv.url_v1, api_key="none", max_retries=0, timeout=60)
            text, finish = "", None
            for chunk in c.completions.create(model="test-model", prompt=PROMPTS[0], max_tokens=300, stream=True,
                                              temperature=0, extra_body={"ignore_eos": True},
                                              stream_options={"include_usage": True}):
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                    result.setdefault("first", time.monotonic())
                if chunk.usage:
                    result["tokens"] = chunk.usage.completion_tokens
            result["finish"], result["text"] = finish, text

        t = threading.Thread(target=consume)
        t.start()
        deadline = time.monotonic() + 30
        while "first" not in result and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "first" in result
        # the engine process, multiprocessing's resource tracker and the render workers' forkserver
        kids = children(srv.proc.pid)
        assert len(kids) == 3 and any("spawn_main" in cmdline(c) for c in kids)
        assert any("forkserver" in cmdline(c) for c in kids)
        srv.terminate()
        assert "finish" not in result  # the request was still in flight when SIGTERM arrived
        t.join(60)
        assert srv.wait(60) == 0
        assert result.get("finish") == "length" and result.get("tokens") == 300, result
        assert all(gone(c, 10) for c in kids)  # the engine process stopped with the server
    finally:
        srv.stop()


def test_killed_server_takes_its_engine_process_along(model_path):
    """SIGKILL on the server (no cleanup runs): the engine process sees its pipe close and exits, no orphan left."""
    import os
    import signal

    srv = ServerProcess(model_path, api_key=None)
    try:
        kids = children(srv.proc.pid)
        assert any("spawn_main" in cmdline(c) for c in kids)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.wait(30)
        assert all(gone(c, 15) for c in kids)
    finally:
        srv.stop()


def _process_cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_async_engine_process(model_path):
    """In-process client of the engine process: outputs stream (deltas rebuilt into cumulative outputs equal to the
    offline ones; with stream_interval=3 a 12-token request reaches its consumer at most 5 times: tokens 1, 4, 7,
    10 and the end), bad input raises ParamError, abort frees blocks, the idle engine process burns no CPU."""
    from pagedllm import EngineConfig, LLM, ParamError, SamplingParams
    from pagedllm.engine.async_engine import AsyncEngine

    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    want = LLM(model_path, device="cpu").generate(PROMPTS, sp, use_tqdm=False)

    async def main() -> None:
        with pytest.raises(ParamError):
            AsyncEngine(EngineConfig(model=model_path, device="cpu"), stream_interval=0)
        ae = AsyncEngine(EngineConfig(model=model_path, device="cpu"), stream_interval=3)
        with pytest.raises(RuntimeError):  # no event loop bound yet
            await ae.add_request("x", {"prompt_token_ids": [1]}, SamplingParams())
        await ae.start()
        try:
            streams = [await ae.add_request(f"p{i}", p, sp) for i, p in enumerate(PROMPTS)]

            async def drain(s):
                return [len(o.outputs[0].token_ids) async for o in s], s.last

            for (counts, last), w in zip(await asyncio.gather(*map(drain, streams)), want):
                assert len(counts) <= 5 and counts[-1] == len(w.outputs[0].token_ids)
                outs = [last]
                got, exp = outs[-1].outputs[0], w.outputs[0]
                assert outs[-1].finished and outs[-1].prompt_token_ids == w.prompt_token_ids
                assert (got.text, got.token_ids, got.finish_reason) == (exp.text, exp.token_ids, exp.finish_reason)
                assert [d[t].logprob for d, t in zip(got.logprobs, got.token_ids)] == pytest.approx(
                    [d[t].logprob for d, t in zip(exp.logprobs, exp.token_ids)], abs=1e-4)
            with pytest.raises(ParamError) as e:
                await ae.add_request("b", {"prompt_token_ids": []}, SamplingParams())
            assert e.value.field == "prompt"
            s = await ae.add_request("c", {"prompt_token_ids": [4, 5, 6]},
                                     SamplingParams(max_tokens=480, ignore_eos=True))
            await s.__anext__()
            s.abort()
            for _ in range(100):
                await asyncio.sleep(0.02)
                st = ae.stats()
                if st.num_running == st.num_waiting == st.num_used_blocks == 0:
                    break
            assert (st.num_running, st.num_waiting, st.num_used_blocks) == (0, 0, 0)
            await asyncio.sleep(0.2)
            steps, ticks = ae.stats().num_steps, _process_cpu_ticks(ae.pid)
            await asyncio.sleep(0.5)
            assert ae.stats().num_steps == steps and _process_cpu_ticks(ae.pid) - ticks <= 1  # asleep on the pipe
        finally:
            await asyncio.to_thread(ae.shutdown)
        assert not ae.is_running and ae.error is None

    asyncio.run(main())


def test_async_engine_build_error_and_crash(model_path):
    """A build error re-raises in the server process with its field; an engine process that dies fails its
    in-flight requests with EngineDeadError and refuses new ones (the server maps both to 503)."""
    import os
    import signal

    from pagedllm import EngineConfig, ParamError, SamplingParams
    from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError

    with pytest.raises(ParamError) as e:
        AsyncEngine(EngineConfig(model=model_path, device="cpu", max_model_len=10 ** 6))
    assert e.value.field == "max_model_len"

    async def main() -> None:
        ae = AsyncEngine(EngineConfig(model=model_path, device="cpu", max_model_len=128))
        assert ae.max_model_len == 128 and ae.tokenizer is not None
        await ae.start()
        s = await ae.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=120,
                                                                                    ignore_eos=True))
        await s.__anext__()
        os.kill(ae.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in s:
                pass
        assert not ae.is_running and "exited unexpectedly" in str(ae.error)
        with pytest.raises(EngineDeadError):
            await ae.add_request("b", {"prompt_token_ids": [1]}, SamplingParams())
        await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())
