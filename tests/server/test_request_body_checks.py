"""The raw-body checks of ``limits.py`` (JSON nesting depth, lone surrogate escapes) against Python's own json
module as the oracle, the finite / 64-bit ranges of ``SamplingParams`` and the key and body middlewares in front of a
real Starlette app in process (issue 34)."""

from __future__ import annotations

import json
import math
import random

import pytest

from pagedllm.entrypoints.openai.limits import body_problem, has_lone_surrogate, json_depth_exceeds
from pagedllm.errors import ParamError
from pagedllm.sampling_params import SamplingParams


def _depth(v) -> int:
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    return 0


def _random_value(rng: random.Random, depth: int):
    kind = rng.random()
    if depth <= 0 or kind < 0.3:
        # strings full of what could fool a byte scanner: brackets, quotes, backslashes, surrogate-like text
        return rng.choice(["[", "]{", '"', "\\", "\\\\ud800", "x\\\"[", "\U0001F600", "plain", 12, 1.5, None, True])
    if kind < 0.65:
        return [_random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}[{{": _random_value(rng, depth - 1) for i in range(rng.randint(0, 3))}


@pytest.mark.parametrize("seed", range(40))
def test_depth_matches_the_parsed_structure(seed):
    rng = random.Random(seed)
    value = {"messages": [_random_value(rng, rng.randint(1, 30)) for _ in range(rng.randint(1, 5))]}
    data = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
    depth = _depth(json.loads(data))
    for limit in (1, depth - 1, depth, depth + 1):
        if limit >= 1:
            assert json_depth_exceeds(data, limit) == (depth > limit), (limit, depth, data[:200])


def test_depth_of_pathological_bodies():
    assert json_depth_exceeds(b"[" * 900 + b"]" * 900, 64)
    assert not json_depth_exceeds(json.dumps({"s": "[" * 10_000}).encode(), 64)  # brackets inside a string
    assert not json_depth_exceeds(json.dumps({"s": "\\" * 7 + '"[[' * 500}).encode(), 2)  # escaped quotes
    assert json_depth_exceeds(b'{"a": "\\\\", "b": ' + b"[" * 70 + b"]" * 70 + b"}", 64)  # an escaped backslash


@pytest.mark.parametrize("text", ["a\ud800", "\udc00b", "\ud800\ud800\udc00", "\udc00\ud800", "x\ud83d\\\ude00",
                                  "\U0001F600", "plain é 一", "\\ud800 as text", "\\\\\ud800", "\ud83d\ude00\udc00"])
@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_lone_surrogates_match_utf8_encodability(text, ensure_ascii):
    try:
        data = json.dumps({"prompt": text, "n": [1, 2]}, ensure_ascii=ensure_ascii).encode()
    except UnicodeEncodeError:  # raw lone surrogates cannot even be sent as UTF-8
        return
    try:
        json.loads(data)["prompt"].encode("utf-8")
        lone = False
    except UnicodeEncodeError:
        lone = True
    assert has_lone_surrogate(data) == lone, (text, data)


def test_body_problem_names_the_flag():
    msg, code = body_problem(b"[" * 100 + b"]" * 100, 64)
    assert code == "json_too_deep" and "--max-json-depth" in msg and "64" in msg
    msg, code = body_problem(b'{"prompt": "\\ud800"}', 64)
    assert code == "invalid_unicode" and "surrogate" in msg
    assert body_problem(json.dumps({"prompt": "\U0001F600" * 100}).encode(), 64) is None


@pytest.mark.parametrize("field", ["repetition_penalty", "temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_sampling_params_refuse_non_finite(field, value):
    with pytest.raises(ParamError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


def test_sampling_params_seed_and_bias_ranges():
    for seed in (-(2 ** 63), 0, 2 ** 64 - 1):
        SamplingParams(seed=seed)
    for seed in (2 ** 64, -(2 ** 63) - 1, 2 ** 70, True):
        with pytest.raises(ParamError) as e:
            SamplingParams(seed=seed)
        assert e.value.field == "seed"
    with pytest.raises(ParamError) as e:
        SamplingParams(logit_bias={5: math.inf})
    assert e.value.field == "logit_bias"


def _app(open_metrics: bool = False):
    """A real Starlette app behind the server's two middlewares, as build_app stacks them."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from pagedllm.entrypoints.openai.auth import APIKeyMiddleware
    from pagedllm.entrypoints.openai.limits import RequestBodyMiddleware

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"size": len(await request.body())})

    app = Starlette(routes=[Route(p, echo, methods=["GET", "POST"]) for p in ("/health", "/metrics", "/tokenize",
                                                                             "/v1/completions")])
    app.add_middleware(RequestBodyMiddleware, max_bytes=4096, max_json_depth=8, route_max_bytes={"/tokenize": 1024})
    app.add_middleware(APIKeyMiddleware, api_keys=["k"], open_metrics=open_metrics)
    return app


@pytest.mark.parametrize("open_metrics", [False, True])
def test_only_health_and_optionally_metrics_are_open(open_metrics):
    from starlette.testclient import TestClient

    client = TestClient(_app(open_metrics))
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == (200 if open_metrics else 401)
    for path in ("/tokenize", "/v1/completions", "/nowhere"):
        r = client.post(path, json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.post("/tokenize", json={}, headers={"Authorization": "Bearer k"}).status_code == 200


def test_route_body_limits_and_shape_checks():
    from starlette.testclient import TestClient

    client = TestClient(_app())
    key = {"Authorization": "Bearer k"}
    body = json.dumps({"prompt": "a" * 2000})
    assert client.post("/v1/completions", content=body, headers=key).json() == {"size": len(body)}
    r = client.post("/tokenize", content=body, headers=key)
    assert r.status_code == 413 and "1024" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b"[" * 9 + b"]" * 9, headers=key)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep"
    r = client.post("/v1/completions", content=b'{"prompt": "\\udfff"}', headers=key)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode"
