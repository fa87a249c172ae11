"""``tool_choice="auto"`` through a real ``pagedllm serve --tool-call-parser NAME`` and the openai client, for the
new parsers: the parsed message, and the stream (content, then each call's id and name, then its arguments in
pieces) adding up to the same calls. The tiny random model writes the call text because a ``structured_outputs``
choice forces it (a random model never would); the parsing is the server's."""

from __future__ import annotations

import json

import openai
import pytest

from server_utils import ServerProcess, tiny_chat_model

pytestmark = pytest.mark.slow

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}},
]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET"})]
# (parser, forced output, expected content)
CASES = {
    "qwen3_coder": ("Checking.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                    "<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>", "Checking."),
    "mistral": ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]'
                '{"tz": "CET"}', "Sure."),
    "pythonic": ("[get_weather(city='Paris', days=3), get_time(tz='CET')]", None),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request):
    s = ServerProcess(tiny_chat_model(), "--max-model-len", "512", "--kv-cache-memory", str(32 << 20),
                      "--tool-call-parser", request.param, "--enable-auto-tool-choice")
    yield request.param, openai.OpenAI(base_url=s.url_v1, api_key=s.api_key, max_retries=0)
    s.stop()


def _kw(text: str) -> dict:
    return dict(model="test-model", messages=[{"role": "user", "content": "Weather and time in Paris?"}],
                tools=TOOLS, max_tokens=200, temperature=0, extra_body={"structured_outputs": {"choice": [text]}})


def test_auto_calls_whole_and_streamed(served):
    parser, client = served
    text, content = CASES[parser]
    r = client.chat.completions.create(**_kw(text))
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == CALLS
    assert len({c.id for c in msg.tool_calls}) == 2
    if parser == "mistral":  # Mistral's templates take only 9-character alphanumeric ids
        assert all(len(c.id) == 9 and c.id.isalnum() for c in msg.tool_calls)

    streamed_content, calls, pieces, finish = "", {}, 0, None
    for chunk in client.chat.completions.create(stream=True, **_kw(text)):
        for ch in chunk.choices:
            streamed_content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:  # the first piece of a call: id, type and the whole name
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = [d.function.name, ""]
                else:
                    assert d.function.name is None
                calls[d.index][1] += d.function.arguments or ""
                pieces += 1
    assert finish == "tool_calls"
    assert (streamed_content or None) == content
    assert [(n, a) for _, (n, a) in sorted(calls.items())] == [(c.function.name, c.function.arguments)
                                                                 for c in msg.tool_calls]
    assert pieces > len(CALLS)  # the arguments arrived in pieces, not in one delta per call


def test_auto_plain_text_stays_content(served):
    parser, client = served
    r = client.chat.completions.create(**_kw("It is sunny in Paris."))
    assert r.choices[0].message.content == "It is sunny in Paris." and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(stream=True, **_kw("It is sunny in Paris."))
    chunks = [ch for chunk in stream for ch in chunk.choices]
    assert "".join(ch.delta.content or "" for ch in chunks) == "It is sunny in Paris."
    assert not any(ch.delta.tool_calls for ch in chunks) and chunks[-1].finish_reason == "stop"
