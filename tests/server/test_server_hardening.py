"""Server hardening (issue 18) against real ``pagedllm serve`` processes on the tiny model.

* Hostile request templates (nested loops, deep recursion, huge string multiplication) sent while another client
  streams: each gets a 4xx, ``/health`` answers within 100 ms throughout, the stream's inter-token gaps stay small.
* Size limits before any work (413 body, stop strings, n, logprobs, max_tokens, prompt ids vs max_model_len).
* Several API keys (flag, file, env), CORS only for the configured origin.
* Engine death: in-flight streams fail within 1 s; ``--no-exit-on-engine-failure`` keeps serving 503s,
  ``--exit-on-engine-failure`` (the default) exits non-zero within 5 s and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from server_utils import (ServerProcess, children, cmdline, descendants, gone, tiny_chat_model,
                          wait_for_grammar_zygote, wait_idle)

KEYS = ("key-one", "key-two", "key-from-file", "key-from-env")
ORIGIN = "http://allowed.example"
RENDER_TIMEOUT = 2.0
MAX_LEN = 512
BODY_LIMIT = 512 * 1024
USER = [{"role": "user", "content": "Hi"}]
HOSTILE = {
    "nested_loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "deep_recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "huge_string": "{{ 'x' * 10000000000 }}",
    "big_string": "{{ 'ab' * 400000000 }}",
    "loop_output": "{% for i in range(99999) %}{{ 'y' * 99999 }}{% endfor %}",
}


@pytest.fixture(scope="module")
def server():
    key_file = tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False)
    key_file.write("# operator keys\nkey-from-file\n")
    key_file.close()
    srv = ServerProcess(tiny_chat_model(), "--max-model-len", str(MAX_LEN), "--trust-request-chat-template",
                        "--template-render-timeout", str(RENDER_TIMEOUT), "--max-num-queued-reqs", "32",
                        "--max-request-body-bytes", str(BODY_LIMIT), "--no-exit-on-engine-failure",
                        "--api-key", "key-one", "key-two", "--api-key-file", key_file.name,
                        "--allowed-origins", json.dumps([ORIGIN]), api_key=None,
                        env={"PAGEDLLM_API_KEY": "key-from-env"})
    srv.api_key = KEYS[0]
    yield srv
    srv.stop()
    os.unlink(key_file.name)


def _post(srv: ServerProcess, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{srv.base_url}{path}", json=body, headers=srv.headers(), timeout=kw.pop("timeout", 30), **kw)


def _error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


class _Streamer(threading.Thread):
    """Streams completions back to back until stopped; records each stream's chunk arrival times."""

    def __init__(self, srv: ServerProcess):
        super().__init__(daemon=True)
        self.srv, self.stop = srv, threading.Event()
        self.streams: list[list[float]] = []
        self.errors: list[str] = []

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 120, "stream": True, "ignore_eos": True,
                "temperature": 0}
        with httpx.Client(timeout=30, headers=self.srv.headers()) as c:
            while not self.stop.is_set():
                times: list[float] = []
                self.streams.append(times)  # filled while it streams
                with c.stream("POST", f"{self.srv.url_v1}/completions", json=body) as r:
                    if r.status_code != 200:
                        self.errors.append(f"{r.status_code}: {r.read()!r}")
                        return
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            if '"error"' in line:
                                self.errors.append(line)
                            times.append(time.monotonic())


_PROBE = r"""
import json, sys, threading, time
import httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
out = []
with httpx.Client(timeout=5) as c:
    while not stop.is_set():
        t = time.perf_counter()
        try:
            status = c.get(sys.argv[1]).status_code
        except httpx.HTTPError:
            status = -1
        out.append((time.perf_counter() - t, status, time.monotonic()))
        time.sleep(0.02)
print(json.dumps(out))
"""


class _Prober:
    """GET /health every 20 ms over a kept-alive connection, from its own process (this one's threads share a GIL
    with the streaming client); ``finish`` returns the (latency, status) samples."""

    def __init__(self, srv: ServerProcess):
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, f"{srv.base_url}/health"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def finish(self) -> list[tuple[float, int]]:
        out, _ = self.proc.communicate("stop\n", timeout=30)
        return [tuple(x) for x in json.loads(out)]


def _gaps(streams: list[list[float]], since: float, until: float) -> list[float]:
    """Inter-token gaps ending in [since, until) within each stream (gaps start after the first token's chunk)."""
    return [b - a for times in streams for a, b in zip(times[1:], times[2:]) if since <= b < until]


def test_hostile_templates_while_streaming(server):
    """The issue's acceptance test: every hostile template is a 4xx within its time budget, while /health stays
    under 100 ms and a concurrent stream keeps its pace (compared with a baseline phase just before, on the same
    possibly busy machine)."""
    streamer = _Streamer(server)
    streamer.start()
    base_prober = _Prober(server)
    time.sleep(0.5)
    t0 = time.monotonic()
    time.sleep(4.0)
    base_samples = base_prober.finish()
    t1 = time.monotonic()
    prober = _Prober(server)
    results, marks = {}, {}
    try:
        for name, tpl in HOSTILE.items():
            t = time.monotonic()
            r = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, "chat_template": tpl})
            results[name] = (r.status_code, time.monotonic() - t, r.json()["error"])
            marks[name] = round(t - t1, 2)
        # and several at once: the pool's workers are all busy, the server still is not
        threads = [threading.Thread(target=lambda: results.setdefault(
            f"parallel{i}", (lambda r: (r.status_code, 0.0, r.json().get("error")))(
                _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 4,
                                                       "chat_template": HOSTILE["nested_loops"]}))))
                   for i in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        time.sleep(0.5)
    finally:
        t2 = time.monotonic()
        streamer.stop.set()
        samples = prober.finish()
        streamer.join(60)
    for name, (status, took, err) in results.items():
        assert 400 <= status < 500, (name, status, err)
        assert err["param"] == "chat_template", (name, err)
        assert took < RENDER_TIMEOUT + 3, (name, took)
    assert results["nested_loops"][2]["code"] == "render_timeout"
    lat, base_lat = [s[0] for s in samples], [s[0] for s in base_samples]
    assert len(lat) > 50 and all(s[1] == 200 for s in samples + base_samples), samples[:5]
    print(f"/health: {len(lat)} probes under attack, max {max(lat) * 1e3:.1f} ms, median "
          f"{statistics.median(lat) * 1e3:.1f} ms (baseline max {max(base_lat) * 1e3:.1f} ms)")
    slow = [(round(s[2] - t1, 2), round(s[0] * 1e3)) for s in samples if s[0] >= 0.05]
    assert max(lat) < 0.1, (slow, marks)  # (seconds into the attack, ms) and when each hostile request started
    assert not streamer.errors, streamer.errors
    base_gaps, gaps = _gaps(streamer.streams, t0, t1), _gaps(streamer.streams, t1, t2)
    assert len(base_gaps) > 20 and len(gaps) > 100
    print(f"stream inter-token gaps under attack: {len(gaps)}, max {max(gaps) * 1e3:.1f} ms, median "
          f"{statistics.median(gaps) * 1e3:.1f} ms (baseline: max {max(base_gaps) * 1e3:.1f} ms, median "
          f"{statistics.median(base_gaps) * 1e3:.1f} ms)")
    # A render burning its time budget takes one CPU: on a small, busy machine the engine feels that (the median
    # may grow); a blocked event loop would show as gaps of whole seconds.
    assert statistics.median(gaps) < 3 * statistics.median(base_gaps) + 0.02
    assert max(gaps) < max(1.0, 3 * max(base_gaps))
    # the pool is whole again: a normal chat request renders at once
    r = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_request_template_benign_and_kwargs(server):
    tpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{{ suffix }}"
    r = _post(server, "/tokenize", {"prompt": "<user>Hi!"})
    want = r.json()["tokens"]
    r = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "chat_template": tpl,
                                               "chat_template_kwargs": {"suffix": "!"}, "return_token_ids": True})
    assert r.status_code == 200, r.text
    _error(_post(server, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"tokenize": False}}),
           400, "chat_template_kwargs")
    _error(_post(server, "/v1/chat/completions", {"messages": USER, "chat_template": "{{ raise_exception('no') }}"}),
           400, "chat_template")
    include = {"messages": USER, "chat_template": "{% include '/etc/passwd' %}"}
    err = _error(_post(server, "/v1/chat/completions", include), 400, "chat_template")
    assert "root:" not in err["message"]  # no loader: templates cannot read files
    _error(_post(server, "/v1/chat/completions", {"messages": USER, "chat_template": "{" * (300 * 1024)}),
           400, "chat_template")
    assert want  # the tokenizer answered through the render workers


BAD = [
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 65}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["s" * 1025]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": "s" * 1025}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 33}, "n"),  # more sequences than --max-num-queued-reqs admits
    ("/v1/completions", {"prompt": "x", "best_of": 129}, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_LEN}, "max_tokens"),
    ("/v1/completions", {"prompt": [1] * MAX_LEN, "max_tokens": 1}, "prompt"),  # counted on ids, before any work
    ("/v1/chat/completions", {"messages": USER, "max_tokens": MAX_LEN}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER * 4097}, "messages"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[b[2] for b in BAD])
def test_size_limits_are_400s(server, path, body, param):
    _error(_post(server, path, body), 400, param)


def test_body_size_limit_is_413_before_parsing(server):
    big = {"prompt": "word " * 120000, "max_tokens": 1}  # ~600 KB > 512 KiB
    err = _error(_post(server, "/v1/completions", big), 413)
    assert str(BODY_LIMIT) in err["message"]

    def chunks():  # no Content-Length: counted while it arrives
        for _ in range(160):
            yield b" " * 4096

    r = httpx.post(f"{server.url_v1}/completions", content=chunks(), headers=server.headers(), timeout=30)
    _error(r, 413)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_several_api_keys(server):
    for key in KEYS:
        r = httpx.get(f"{server.url_v1}/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, (key, r.text)
    for key in ("key-three", "key-on", KEYS[0] + "x", "Key-one"):
        r = httpx.get(f"{server.url_v1}/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 401, key


def test_cors_only_for_allowed_origin(server):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(f"{server.url_v1}/chat/completions", headers={"Origin": ORIGIN, **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    bad = httpx.options(f"{server.url_v1}/chat/completions", headers={"Origin": "http://evil.example", **pre})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    r = httpx.get(f"{server.url_v1}/models", headers={"Origin": "http://evil.example", **server.headers()})
    assert "access-control-allow-origin" not in r.headers


def test_nothing_leaked(server):
    m = wait_idle(server.base_url, api_key=server.api_key)
    assert (m["pagedllm:num_requests_running"], m["pagedllm:num_requests_waiting"],
            m["pagedllm:kv_cache_used_blocks"]) == (0, 0, 0)
    assert "Traceback" not in server.output()


def _engine_pid(srv: ServerProcess) -> int:
    return next(c for c in children(srv.proc.pid) if "spawn_main" in cmdline(c))


def _streams_under_kill(srv: ServerProcess, n: int = 8) -> tuple[list[float], float]:
    """Start ``n`` long streams, SIGKILL the engine process mid-stream; returns each stream's end time after the
    kill (seconds) and the kill's time."""
    ends: list[float] = []
    started = threading.Barrier(n + 1)
    errors: list[str] = []

    def one() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30, headers=srv.headers()) as c:
            with c.stream("POST", f"{srv.url_v1}/completions", json=body) as r:
                first = True
                try:
                    for line in r.iter_lines():
                        if first and line.startswith("data: {"):
                            first = False
                            started.wait(30)
                        if '"error"' in line:
                            errors.append(line)
                except httpx.HTTPError as e:  # the server went away: that is an end too
                    errors.append(repr(e))
        ends.append(time.monotonic())

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    started.wait(60)
    killed = time.monotonic()
    os.kill(_engine_pid(srv), signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert len(ends) == n and len(errors) == n, errors
    return [e - killed for e in ends], killed


def test_engine_killed_without_exit_keeps_serving_503(server):
    """Runs last in this module (it kills the engine): today's behaviour under --no-exit-on-engine-failure."""
    took, _ = _streams_under_kill(server)
    print(f"streams failed {max(took) * 1e3:.0f} ms after the engine was killed")
    assert max(took) < 1.0, took
    assert server.proc.poll() is None
    assert httpx.get(f"{server.base_url}/health").status_code == 503
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    _error(r, 503)
    time.sleep(1.0)
    assert server.proc.poll() is None


def test_engine_killed_exits_nonzero_within_5s():
    """--exit-on-engine-failure (the default): fail the in-flight streams, exit with code 1, leave no process."""
    srv = ServerProcess(tiny_chat_model(), "--max-model-len", str(MAX_LEN), api_key=None)
    try:
        wait_for_grammar_zygote(srv.proc.pid)  # (started after /health: its processes must go too)
        procs = descendants(srv.proc.pid)
        assert any("forkserver" in cmdline(p) for p in procs) and len(procs) >= 5  # engine, tracker, fs, 2 workers
        took, killed = _streams_under_kill(srv)
        assert max(took) < 1.0, took
        code = srv.wait(10)
        exited = time.monotonic() - killed
        print(f"streams failed within {max(took) * 1e3:.0f} ms; server exited {exited:.2f} s after the kill, "
              f"code {code}")
        assert code != 0 and exited < 5.0, (code, exited, srv.output())
        assert all(gone(p, 10) for p in procs), [cmdline(p) for p in procs if not gone(p, 0)]
    finally:
        srv.stop()
