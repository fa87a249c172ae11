"""Bad requests against the real server on the embedded default model (SmolLM2, started without MODEL).

Every bad input must get the right 4xx with an OpenAI-shaped error (``{"error": {"message", "type", "param",
"code"}}``) naming the field, never a 500, and the server must keep serving (and hold no request or KV block)
afterwards.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import API_KEY, ServerProcess, wait_idle

MAX_LEN = 64
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(None, "--max-model-len", str(MAX_LEN), "--max-num-seqs", "8", startup_timeout=180)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url_v1, api_key=API_KEY, max_retries=0, timeout=60)


def _check_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
        assert param.split(".")[0] in err["message"], err
    return err


C = {"prompt": "Hello", "max_tokens": 2}
BAD_COMPLETIONS = [
    ({**C, "temperature": -1}, "temperature"),
    ({**C, "temperature": "hot"}, "temperature"),
    ({**C, "top_p": 0}, "top_p"),
    ({**C, "top_p": 1.5}, "top_p"),
    ({**C, "top_k": -2}, "top_k"),
    ({**C, "min_p": 1.5}, "min_p"),
    ({**C, "presence_penalty": 3}, "presence_penalty"),
    ({**C, "frequency_penalty": -2.5}, "frequency_penalty"),
    ({**C, "repetition_penalty": 0}, "repetition_penalty"),
    ({**C, "n": 0}, "n"),
    ({**C, "n": "two"}, "n"),
    ({**C, "n": 2, "best_of": 1}, "best_of"),
    ({**C, "max_tokens": 0}, "max_tokens"),
    ({**C, "max_tokens": "10"}, "max_tokens"),
    ({**C, "max_tokens": MAX_LEN}, "max_tokens"),  # prompt + max_tokens exceeds max_model_len
    ({**C, "min_tokens": 5}, "min_tokens"),  # > max_tokens
    ({**C, "logprobs": 21}, "logprobs"),
    ({**C, "logprobs": -1}, "logprobs"),
    ({**C, "seed": "x"}, "seed"),
    ({**C, "stop": [1]}, "stop"),
    ({**C, "stop": [""]}, "stop"),
    ({**C, "stream": "yes"}, "stream"),
    ({"max_tokens": 2}, "prompt"),
    ({**C, "prompt": 5}, "prompt"),
    ({**C, "prompt": ""}, "prompt"),
    ({**C, "prompt": []}, "prompt"),
    ({**C, "prompt": [-1]}, "prompt"),
    ({**C, "prompt": [10 ** 9]}, "prompt"),
    ({**C, "prompt": [10 ** 9], "echo": True}, "prompt"),
    ({**C, "prompt": "word " * 200}, "prompt"),  # oversized prompt
    ({**C, "model": 123}, "model"),
    ({**C, "temperature": -1, "stream": True}, "temperature"),  # rejected before the stream starts
]
M = {"messages": USER, "max_tokens": 2}
BAD_CHAT = [
    ({"max_tokens": 2}, "messages"),
    ({**M, "messages": []}, "messages"),
    ({**M, "messages": "hi"}, "messages"),
    ({**M, "messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
    ({**M, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({**M, "messages": [{"role": "user", "content": "word " * 200}]}, "messages"),  # oversized prompt
    ({**M, "logprobs": "yes"}, "logprobs"),
    ({**M, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**M, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**M, "temperature": 2.5}, "temperature"),
    ({**M, "stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=lambda x: x if isinstance(x, str) else "")
def test_bad_completion_params(server, body, param):
    r = httpx.post(f"{server.url_v1}/completions", json=body, headers=server.headers(), timeout=30)
    _check_error(r, 400, param)


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=lambda x: x if isinstance(x, str) else "")
def test_bad_chat_params(server, body, param):
    r = httpx.post(f"{server.url_v1}/chat/completions", json=body, headers=server.headers(), timeout=30)
    _check_error(r, 400, param)


@pytest.mark.parametrize("raw", [b"{bad", b"", b"[1, 2]", b"null", b"\xff\xfe", b'{"prompt": "x",}'])
def test_invalid_json_is_400(server, raw):
    for path in ("/completions", "/chat/completions"):
        r = httpx.post(f"{server.url_v1}{path}", content=raw, timeout=30,
                       headers={**server.headers(), "Content-Type": "application/json"})
        _check_error(r, 400)


def test_auth(server):
    good = openai.OpenAI(base_url=server.url_v1, api_key=API_KEY, max_retries=0)
    assert good.models.list().data
    for key in ("wrong-key", API_KEY + "x", API_KEY[:-1]):
        bad = openai.OpenAI(base_url=server.url_v1, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model="test-model", prompt="Hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    for headers in ({}, {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"}):
        r = httpx.post(f"{server.url_v1}/chat/completions", json=M, headers=headers, timeout=30)
        _check_error(r, 401)
        assert httpx.get(f"{server.url_v1}/models", headers=headers).status_code == 401
        for path in ("/tokenize", "/detokenize"):  # they take a render worker: keyed like generation (issue 34)
            _check_error(httpx.post(f"{server.base_url}{path}", json={"prompt": "x"}, headers=headers), 401)
        for path in ("/metrics", "/version", "/no/such/route"):
            _check_error(httpx.get(f"{server.base_url}{path}", headers=headers), 401)
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # only the liveness probe stays open
    assert httpx.get(f"{server.base_url}/metrics", headers=server.headers()).status_code == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert e.value.param == "model" and "no-such-model" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=USER, max_tokens=2, stream=True)


def test_client_sees_field_names(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="test-model", prompt="word " * 200, max_tokens=2)
    assert e.value.param == "prompt" and str(MAX_LEN) in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="test-model", messages=USER, max_tokens=2, top_p=7)
    assert e.value.param == "top_p"


def test_other_http_errors(server):
    h = server.headers()
    _check_error(httpx.get(f"{server.base_url}/no/such/route", headers=h), 404)
    _check_error(httpx.get(f"{server.url_v1}/completions", headers=h), 405)
    _check_error(httpx.post(f"{server.base_url}/detokenize", json={"tokens": [-5]}, headers=h), 400, "tokens")
    _check_error(httpx.post(f"{server.base_url}/tokenize", json={}, headers=h), 400, "prompt")


def test_still_serving_after_errors(server, client):
    """Runs last: nothing leaked from the rejected requests, and real generation works (SmolLM2 + its template)."""
    r = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens <= 8
    r = client.completions.create(model="test-model", prompt="The capital of France is", max_tokens=3, temperature=0)
    assert "Paris" in r.choices[0].text
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    m = wait_idle(server.base_url)
    assert (m["pagedllm:num_requests_running"], m["pagedllm:num_requests_waiting"],
            m["pagedllm:kv_cache_used_blocks"]) == (0, 0, 0)
    assert "Traceback" not in server.output()


def test_bad_serve_flags_exit_2_naming_the_flag():
    """``pagedllm serve`` with a bad flag value prints one line naming it and exits 2 (argparse's code), no traceback;
    checked for a server-side flag and for an engine flag that only the engine process can judge."""
    import subprocess
    import sys

    from server_utils import tiny_chat_model

    model = tiny_chat_model()
    cases = ((["--stream-interval", "0"], "stream_interval"), (["--max-model-len", "1000000"], "max_model_len"),
             (["--engine-cpus", "0-x"], "engine_cpus"))
    for flag, field in cases:
        res = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", model, "--device", "cpu", "--port", "1",
                              *flag], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, res.stderr
        assert f"error: {field}:" in res.stderr and "Traceback" not in res.stderr, res.stderr
