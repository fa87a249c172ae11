"""Structured outputs, tool calls and the sampling surface through a real ``pagedllm serve`` and the openai client.

The server runs the tiny random Llama with SmolLM2's tokenizer (``server_utils.tiny_chat_model``): random weights
give arbitrary text, so every valid output here is the grammar's doing, not the model's.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server_utils import ServerProcess, tiny_chat_model
from structured_schemas import SCHEMAS, SMALL_SCHEMAS

CHAT = [{"role": "user", "content": "Give me a record."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["tz"],
                                       "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(tiny_chat_model(), "--max-model-len", "512", "--kv-cache-memory", str(64 << 20),
                      "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url_v1, api_key=server.api_key, max_retries=0)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url_v1}{path}", json={"model": "test-model", **body}, headers=server.headers(),
                      timeout=120)


def served_schema_generations(server, schemas: list[dict], per_schema: int, max_tokens: int) -> int:
    """``per_schema`` samples of each schema as concurrent chat requests (n=2, temperature 1) through the
    official async client, half of them streamed: the count of outputs that finished, parsed and validated."""
    async def one(client, i: int, schema: dict, k: int) -> list[str]:
        kw = dict(model=server.served_name, messages=CHAT, max_tokens=max_tokens, temperature=1.0, n=2,
                  seed=1000 * i + k, response_format={"type": "json_schema", "json_schema": {
                      "name": f"s{i}", "schema": schema, "strict": True}})
        if k % 2 == 0:
            r = await client.chat.completions.create(**kw)
            assert all(c.finish_reason == "stop" for c in r.choices), r.choices
            return [c.message.content for c in r.choices]
        texts, finish = ["", ""], [None, None]
        async for chunk in await client.chat.completions.create(**kw, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finish[c.index] = c.finish_reason or finish[c.index]
        assert finish == ["stop", "stop"], (finish, texts)
        return texts

    async def run() -> int:
        client = openai.AsyncOpenAI(base_url=server.url_v1, api_key=server.api_key, max_retries=0, timeout=600)
        which = [i for i in range(len(schemas)) for _ in range(per_schema // 2)]
        results = await asyncio.gather(*(one(client, i, schemas[i], k) for k, i in enumerate(which)))
        n = 0
        for i, texts in zip(which, results):
            for text in texts:
                jsonschema.validate(json.loads(text), schemas[i])
                n += 1
        await client.close()
        return n

    return asyncio.run(run())


def test_200_json_schema_generations_served(server):
    """4 schemas x 50 samples, all in flight at once (100 requests, half streamed): all parse and validate."""
    assert served_schema_generations(server, SCHEMAS, 50, 200) == 200


@pytest.mark.slow
def test_200_json_schema_generations_served_smollm2():
    """The real model (the embedded SmolLM2) behind pagedllm serve: 200 samples, all parse and validate."""
    srv = ServerProcess(None, "--max-model-len", "512", "--max-num-seqs", "200", startup_timeout=180)
    try:
        assert served_schema_generations(srv, SMALL_SCHEMAS, 50, 120) == 200
    finally:
        srv.stop()


def test_json_object_and_completions_regex_choice(client):
    # json_object has unbounded strings: a random model may run to max_tokens, but what stops is a JSON object
    r = client.chat.completions.create(model="test-model", messages=CHAT, max_tokens=100, temperature=1.0, seed=3,
                                       n=8, response_format={"type": "json_object"})
    assert all(c.message.content.startswith("{") for c in r.choices)
    stopped = [c for c in r.choices if c.finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(c.message.content), dict) for c in stopped)
    r = client.completions.create(model="test-model", prompt="id:", max_tokens=30, temperature=1.0, n=4,
                                  extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{4}"}})
    assert all(__import__("re").fullmatch(r"[A-Z]{2}-\d{4}", c.text) for c in r.choices), r.choices
    r = client.completions.create(model="test-model", prompt="pick:", max_tokens=10, temperature=1.0, n=4,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.text in ("red", "green", "blue") for c in r.choices)


class Person(BaseModel):
    name: str = Field(max_length=16)  # bounded: a random model's string would otherwise run to max_tokens
    age: int = Field(ge=0, le=150)
    likes_cats: bool


def test_openai_parse_with_pydantic_model(client):
    r = client.chat.completions.parse(model="test-model", messages=CHAT, max_tokens=200, temperature=0.5, seed=1,
                                      response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person)


def test_streamed_json_matches_schema(client):
    schema = SCHEMAS[0]
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="test-model", messages=CHAT, max_tokens=200, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}) if c.choices)
    full = client.chat.completions.create(model="test-model", messages=CHAT, max_tokens=200, temperature=0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "s", "schema": schema}})
    assert text == full.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"logit_bias": {"abc": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [10 ** 9]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_fields_are_400_naming_them(server, body, param):
    r = _post(server, "/chat/completions", {"messages": CHAT, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or err["param"].startswith(param + "."), err
    assert _post(server, "/chat/completions", {"messages": CHAT, "max_tokens": 2}).status_code == 200  # alive


def test_logit_bias_forces_and_bans_served(client, server):
    base = client.completions.create(model="test-model", prompt="Hello", max_tokens=4, temperature=0,
                                     extra_body={"return_token_ids": True})
    ids = base.choices[0].model_extra["token_ids"]
    forced = client.completions.create(model="test-model", prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={"42": 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].model_extra["token_ids"] == [42] * 4
    banned = client.completions.create(model="test-model", prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={str(ids[0]): -100}, extra_body={"return_token_ids": True})
    assert ids[0] not in banned.choices[0].model_extra["token_ids"]
    allowed = client.completions.create(model="test-model", prompt="Hello", max_tokens=6, temperature=1.0, seed=0,
                                        extra_body={"return_token_ids": True, "allowed_token_ids": [42, 43, 44]})
    assert set(allowed.choices[0].model_extra["token_ids"]) <= {42, 43, 44}


def _calls(msg) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]


def _stream_calls(client, **kw) -> list[tuple[str, dict]]:
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"name": "", "args": ""})
                if d.function.name:
                    c["name"] = d.function.name
                c["args"] += d.function.arguments or ""
    return [(c["name"], json.loads(c["args"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate_and_stream_agrees(client, tool_choice):
    schemas = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    # parallel_tool_calls=False caps "required" at one call (maxItems 1): a random model never stops listing calls
    kw = dict(model="test-model", messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=200, parallel_tool_calls=False)
    r = client.chat.completions.create(temperature=1.0, n=6, seed=5, **kw)
    for ch in r.choices:
        calls = _calls(ch.message)
        assert calls, ch.message
        for name, args in calls:
            jsonschema.validate(args, schemas[name])
        if isinstance(tool_choice, dict):
            assert [n for n, _ in calls] == ["get_weather"]
    greedy = client.chat.completions.create(temperature=0, **kw)
    assert _stream_calls(client, temperature=0, **kw) == _calls(greedy.choices[0].message)


def test_auto_tool_choice_hermes_parser(client):
    """auto: the hermes parser turns <tool_call> text into tool_calls (the text itself is forced by a regex, since
    a random model would never write it)."""
    call = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    kw = dict(model="test-model", messages=[{"role": "user", "content": "time?"}], tools=[TIME], max_tokens=60,
              temperature=0, extra_body={"structured_outputs": {"choice": [call]}})
    r = client.chat.completions.create(**kw)
    assert _calls(r.choices[0].message) == [("get_time", {"tz": "UTC"})]
    assert r.choices[0].finish_reason == "tool_calls"
    assert _stream_calls(client, **kw) == [("get_time", {"tz": "UTC"})]
    plain = client.chat.completions.create(model="test-model", messages=CHAT, tools=[TIME], max_tokens=8,
                                           temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
