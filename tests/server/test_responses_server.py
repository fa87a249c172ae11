"""``/v1/responses`` through the official ``openai`` client against a real server process.

The oracle is the server's own chat path: a greedy response to a conversation must equal the greedy chat completion
of the same messages (same template, same render, same engine), streamed or not, chained by
``previous_response_id`` or not. The store's LRU bound is checked through the server (count) and on the store
itself (bytes).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pagedllm.entrypoints.openai import tool_calling as tc
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.serving_responses import ResponseEventStream
from server_utils import ServerProcess, tiny_chat_model

STORE_ITEMS = 3
ECHO = {"type": "function", "name": "echo", "description": "Say a word",
        "parameters": {"type": "object", "properties": {"text": {"enum": ["hi", "bye"]}}, "required": ["text"]}}
ECHO_CHAT = {"type": "function", "function": {k: v for k, v in ECHO.items() if k != "type"}}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(tiny_chat_model(), "--max-model-len", "256", "--max-stored-responses", str(STORE_ITEMS),
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url_v1, api_key=server.api_key, max_retries=0)


def chat_text(client, messages, max_tokens, **kw) -> str:
    out = client.chat.completions.create(model="test-model", messages=messages, max_tokens=max_tokens,
                                         temperature=0, **kw)
    return out.choices[0].message.content


def test_plain_response_equals_chat_completion(client):
    r = client.responses.create(model="test-model", input="Tell me a story", instructions="You are terse.",
                                max_output_tokens=12, temperature=0)
    expected = chat_text(client, [{"role": "system", "content": "You are terse."},
                                  {"role": "user", "content": "Tell me a story"}], 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "test-model"
    assert r.output_text == expected and expected
    assert [it.type for it in r.output] == ["message"]
    # the random model never stops by itself in 12 tokens: the cut is reported as OpenAI does
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == r.usage.input_tokens + 12
    # the same items as a list of messages with input_text parts
    r2 = client.responses.create(model="test-model", max_output_tokens=12, temperature=0, input=[
        {"role": "system", "content": "You are terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]}])
    assert r2.output_text == expected


def test_streamed_events_and_text(client):
    whole = client.responses.create(model="test-model", input="Hello there", max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model="test-model", input="Hello there", max_output_tokens=10,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.incomplete"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    assert text == whole.output_text and deltas
    done = events[kinds.index("response.output_text.done")]
    item = events[kinds.index("response.output_item.done")].item
    assert done.text == text and item.content[0].text == text and item.status == "completed"
    assert {d.item_id for d in deltas} == {item.id}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.output_text == text and final.status == "incomplete" and final.usage.output_tokens == 10
    # the streamed response was stored like a whole one
    assert client.responses.retrieve(final.id).output_text == text


def test_function_tool_round_trip(client):
    """A forced tool choice gives a function_call item; its output sent back continues the conversation."""
    r = client.responses.create(model="test-model", input="Say hi with the tool", tools=[ECHO],
                                tool_choice={"type": "function", "name": "echo"}, max_output_tokens=30,
                                temperature=0)
    assert [it.type for it in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "echo" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ECHO["parameters"])
    # streamed, the arguments arrive as deltas of one function_call item
    events = list(client.responses.create(model="test-model", input="Say hi with the tool", tools=[ECHO],
                                          tool_choice={"type": "function", "name": "echo"}, max_output_tokens=30,
                                          temperature=0, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == call.arguments and len(done) == 1 and done[0].arguments == args and done[0].name == "echo"
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == args

    nxt = client.responses.create(model="test-model", previous_response_id=r.id, max_output_tokens=8,
                                  temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                         "output": "hi"}])
    expected = chat_text(client, [
        {"role": "user", "content": "Say hi with the tool"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "echo", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "hi"}], 8)
    assert nxt.previous_response_id == r.id and [it.type for it in nxt.output] == ["message"]
    assert nxt.output_text == expected
    # tool_choice "required" is forced by a grammar too: one call, valid arguments
    req = client.responses.create(model="test-model", input="Say bye", tools=[ECHO], tool_choice="required",
                                  parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    assert [it.type for it in req.output] == ["function_call"] and req.status == "completed"
    jsonschema.validate(json.loads(req.output[0].arguments), ECHO["parameters"])


def test_auto_tool_choice_matches_chat(client):
    """tool_choice auto (the server's hermes parser): the tools are rendered as chat renders them and the text is
    parsed as chat parses it; the random model writes no call, so the answer is a message, streamed or not."""
    kw = dict(model="test-model", input="Maybe call echo", tools=[ECHO], max_output_tokens=12, temperature=0)
    r = client.responses.create(**kw)
    expected = client.chat.completions.create(model="test-model", messages=[{"role": "user",
                                                                             "content": "Maybe call echo"}],
                                              tools=[ECHO_CHAT], max_tokens=12, temperature=0).choices[0].message
    assert not expected.tool_calls and [it.type for it in r.output] == ["message"]
    assert r.output_text == expected.content and r.tool_choice == "auto"
    events = list(client.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


def test_previous_response_chaining(client, server):
    r1 = client.responses.create(model="test-model", input="What is a cat?", instructions="Answer briefly.",
                                 max_output_tokens=8, temperature=0)
    r2 = client.responses.create(model="test-model", input="And a dog?", previous_response_id=r1.id,
                                 max_output_tokens=8, temperature=0)
    # instructions belong to r1 only (OpenAI: they are not carried over)
    expected = chat_text(client, [{"role": "user", "content": "What is a cat?"},
                                  {"role": "assistant", "content": r1.output_text},
                                  {"role": "user", "content": "And a dog?"}], 8)
    assert r2.output_text == expected
    r3 = client.responses.create(model="test-model", input=[{"role": "user", "content": "And a bird?"}],
                                 previous_response_id=r2.id, max_output_tokens=8, temperature=0)
    assert r3.output_text == chat_text(client, [{"role": "user", "content": "What is a cat?"},
                                                {"role": "assistant", "content": r1.output_text},
                                                {"role": "user", "content": "And a dog?"},
                                                {"role": "assistant", "content": r2.output_text},
                                                {"role": "user", "content": "And a bird?"}], 8)
    got = client.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == r2.output_text and got.previous_response_id == r1.id
    deleted = client.responses.delete(r2.id)
    assert deleted is None  # the client returns nothing; the body is checked below on a raw request
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r2.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="test-model", input="x", previous_response_id=r2.id)
    assert e.value.body["param"] == "previous_response_id"
    r4 = client.responses.create(model="test-model", input="q", max_output_tokens=2, temperature=0)
    body = httpx.delete(f"{server.url_v1}/responses/{r4.id}", headers=server.headers()).json()
    assert body == {"id": r4.id, "object": "response.deleted", "deleted": True}


def test_unknown_ids_are_404(client, server):
    for call in (lambda: client.responses.retrieve("resp_missing"),
                 lambda: client.responses.delete("resp_missing"),
                 lambda: client.responses.create(model="test-model", input="hi",
                                                 previous_response_id="resp_missing")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "invalid_request_error" and "resp_missing" in e.value.body["message"]
        assert e.value.body["code"] == "response_not_found"
    r = client.responses.create(model="test-model", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:  # only background responses can be cancelled
        client.responses.cancel(r.id)
    assert e.value.body["param"] == "response_id"


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ECHO], "tool_choice": {"type": "function", "name": "missing"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": []}, "input"),
])
def test_unsupported_or_bad_fields_are_400(client, extra, param):
    body = {"model": "test-model", "input": "hi", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    r = client.responses.create(model="test-model", input="Is it raining?", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "yn", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_store_is_lru_bounded(client):
    """At most --max-stored-responses are kept, least recently used evicted first; store=false keeps nothing."""
    ids = [client.responses.create(model="test-model", input=f"n{i}", max_output_tokens=1).id
           for i in range(STORE_ITEMS)]
    client.responses.retrieve(ids[0])  # now the most recently used
    extra = client.responses.create(model="test-model", input="one more", max_output_tokens=1).id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])  # the least recently used went
    for rid in (ids[0], ids[2], extra):
        assert client.responses.retrieve(rid).id == rid
    unstored = client.responses.create(model="test-model", input="forget me", max_output_tokens=1, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert client.responses.retrieve(extra).id == extra  # nothing was evicted for it


def test_store_byte_bound():
    def resp(rid: str, text: str) -> dict:
        return {"id": rid, "object": "response", "output": [{"type": "message", "content": [text]}]}

    one = ResponseStore(max_items=100, max_bytes=0)
    size = len(json.dumps(resp("a", "x" * 100))) + len(json.dumps([{"role": "user", "content": "q"}]))
    store = ResponseStore(max_items=100, max_bytes=2 * size + size // 2)
    msgs = [{"role": "user", "content": "q"}]
    for rid in "abc":
        assert store.put(resp(rid, "x" * 100), msgs)
    assert "a" not in store and "b" in store and "c" in store and store.bytes == 2 * size
    store.get("b")
    assert store.put(resp("d", "x" * 100), msgs)
    assert "c" not in store and {"b", "d"} == {r for r in "abcd" if r in store}
    assert not store.put(resp("e", "x" * 10_000), msgs)  # bigger than the whole store: not kept, nothing evicted
    assert len(store) == 2 and not one.put(resp("a", ""), msgs) and len(one) == 0
    assert store.delete("b") and not store.delete("b") and store.bytes == size


def test_streamed_tool_calls_assemble_like_the_whole_parse():
    """The event stream of an ``auto`` answer that does call tools (the random model never writes one): the real
    hermes parser's streamed steps, fed a few characters at a time, give the items its whole-text parse gives."""
    text = ('Let me check.\n<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>\n'
            '<tool_call>{"name": "echo", "arguments": {"text": "bye"}}</tool_call>')
    whole = tc.new_tool_parser("hermes").extract_tool_calls(text, None)
    parser, ev, events, sent = tc.new_tool_parser("hermes"), ResponseEventStream(), [], ""
    for i in range(0, len(text), 5):
        delta = text[i:i + 5]
        events += ev.parser_delta(parser.extract_tool_calls_streaming(sent, sent + delta, delta, [], [], [], None))
        sent += delta
    events += ev.parser_delta(parser.finish_streaming(text, None)) + ev.close_all()
    data = [json.loads(e.split("data: ", 1)[1]) for e in events]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    items = [d["item"] for d in data if d["type"] == "response.output_item.done"]
    assert [it["type"] for it in items] == ["message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "".join(d["delta"] for d in data
                                                      if d["type"] == "response.output_text.delta")
    assert items[0]["content"][0]["text"].strip() == whole.content
    for item, call in zip(items[1:], whole.tool_calls):
        args = "".join(d["delta"] for d in data if d["type"] == "response.function_call_arguments.delta"
                       and d["item_id"] == item["id"])
        assert (item["name"], item["arguments"], args) == (call.function.name, call.function.arguments, args)
        assert json.loads(args) == json.loads(call.function.arguments)
    assert ev.output == items
