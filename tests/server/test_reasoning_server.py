"""``--reasoning-parser`` end to end: a real server process, the official ``openai`` client, a scripted model.

The model (``reasoning_models.scripted_reasoning_model``) emits a fixed script under greedy decoding, think tags and
harmony channels included, so each parser's split is known exactly: the whole response's ``reasoning_content`` and
``content`` must be the script's parts, and the streamed deltas must add up to the same. The oracle for prompts
is the tokenizer's own ``apply_chat_template`` (its token count equals the response's ``usage.prompt_tokens``).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from reasoning_models import (ANSWER, HARMONY_ANSWER, HARMONY_REASONING, HARMONY_TEMPLATE, PLAIN, REASONING,
                              scripted_reasoning_model)
from server_utils import ServerProcess

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return scripted_reasoning_model(tmp_path_factory.mktemp("reasoning") / "model")


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _server(model: str, *extra: str):
    srv = ServerProcess(model, "--max-model-len", "256", *extra)
    client = openai.OpenAI(base_url=srv.url_v1, api_key=srv.api_key, max_retries=0)
    return srv, client


@pytest.fixture(scope="module")
def qwen3(model):
    srv, client = _server(model, "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser",
                          "hermes")
    yield client
    srv.stop()


def whole(client, **kw):
    r = client.chat.completions.create(model="test-model", messages=MESSAGES, temperature=0, max_tokens=40, **kw)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning"] == msg.model_extra["reasoning_content"]  # vLLM's two names, one value
    return msg.model_extra["reasoning_content"], msg.content, r


def streamed(client, **kw):
    reasoning, content, tool_args, finish = [], [], [], None
    for chunk in client.chat.completions.create(model="test-model", messages=MESSAGES, temperature=0,
                                                max_tokens=40, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            extra = d.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            assert not (extra.get("reasoning_content") and d.content), "a chunk carries reasoning or content"
            reasoning.append(extra.get("reasoning_content") or "")
            content.append(d.content or "")
            for call in d.tool_calls or []:
                tool_args.append(call.function.arguments or "")
            finish = ch.finish_reason or finish
    return "".join(reasoning) or None, "".join(content) or None, "".join(tool_args), finish


@pytest.mark.slow
def test_qwen3_splits_reasoning_whole_and_streamed(qwen3):
    reasoning, content, r = whole(qwen3)
    assert (reasoning, content) == (REASONING, ANSWER)
    assert r.choices[0].finish_reason == "stop"
    assert streamed(qwen3)[:2] == (REASONING, ANSWER)
    hide = {"include_reasoning": False}  # vLLM's field: the reasoning is left out, the answer stays the same
    assert whole(qwen3, extra_body=hide)[:2] == (None, ANSWER)
    assert streamed(qwen3, extra_body=hide)[:2] == (None, ANSWER)


@pytest.mark.slow
def test_usage_counts_reasoning_tokens(qwen3, tokenizer):
    """vLLM's ``usage.completion_tokens_details.reasoning_tokens``: the script's tokens between the think tags, in
    the whole response and in the stream's usage chunk, summed over n choices, counted when the reasoning is left
    out of the message too; 0 when the template closed the thinking in the prompt (no parser: no details, below)."""
    n = len(tokenizer.encode(REASONING, add_special_tokens=False))
    r = whole(qwen3)[2]
    assert r.usage.completion_tokens_details.reasoning_tokens == n
    assert r.usage.completion_tokens > n + 2  # the tags and the answer are not reasoning
    for choices in (1, 2):
        chunks = list(qwen3.chat.completions.create(model="test-model", messages=MESSAGES, temperature=0,
                                                    max_tokens=40, n=choices, stream=True,
                                                    stream_options={"include_usage": True}))
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens_details.reasoning_tokens == choices * n
    two = qwen3.chat.completions.create(model="test-model", messages=MESSAGES, temperature=0, max_tokens=40, n=2)
    assert two.usage.completion_tokens_details.reasoning_tokens == 2 * n
    hidden = whole(qwen3, extra_body={"include_reasoning": False})[2]
    assert hidden.usage.completion_tokens_details.reasoning_tokens == n
    off = whole(qwen3, extra_body={"chat_template_kwargs": {"enable_thinking": False}})[2]
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.slow
def test_enable_thinking_false_reaches_the_template(qwen3, tokenizer):
    """The kwarg changes the rendered prompt (its tokens are the tokenizer's own rendering) and the script: no
    thinking, so the whole output is content."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    reasoning, content, r = whole(qwen3, extra_body=off)
    assert (reasoning, content) == (None, PLAIN)
    expect = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, enable_thinking=False, tokenize=False)
    default = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert "</think>" in expect and expect != default
    assert r.usage.prompt_tokens == len(tokenizer.encode(expect, add_special_tokens=False))
    assert whole(qwen3)[2].usage.prompt_tokens == len(tokenizer.encode(default, add_special_tokens=False))
    assert streamed(qwen3, extra_body=off)[:2] == (None, PLAIN)


@pytest.mark.slow
def test_reasoning_effort_is_rendered(qwen3, tokenizer):
    _, _, r = whole(qwen3, reasoning_effort="low")
    expect = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, reasoning_effort="low",
                                           tokenize=False)
    assert "Reasoning: low" in expect
    assert r.usage.prompt_tokens == len(tokenizer.encode(expect, add_special_tokens=False))
    # chat_template_kwargs, being explicit, win over the field
    _, _, r2 = whole(qwen3, reasoning_effort="low", extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
    high = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, reasoning_effort="high", tokenize=False)
    assert r2.usage.prompt_tokens == len(tokenizer.encode(high, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError) as e:
        whole(qwen3, reasoning_effort="extreme")
    assert "reasoning_effort" in str(e.value)


@pytest.mark.slow
def test_earlier_reasoning_reaches_the_template(qwen3, tokenizer):
    """An assistant turn sent back with its reasoning (either of vLLM's names) is rendered by a template that reads
    ``reasoning_content`` (Qwen3's does)."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ANSWER},
             {"role": "user", "content": "again"}]
    plain = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    for name in ("reasoning_content", "reasoning"):
        sent = [turns[0], {**turns[1], name: REASONING}, turns[2]]
        r = qwen3.chat.completions.create(model="test-model", messages=sent, temperature=0, max_tokens=40)
        expect = tokenizer.apply_chat_template([turns[0], {**turns[1], "reasoning_content": REASONING}, turns[2]],
                                               add_generation_prompt=True, tokenize=False)
        assert f"<think>{REASONING}</think>{ANSWER}" in expect and expect != plain
        assert r.usage.prompt_tokens == len(tokenizer.encode(expect, add_special_tokens=False))
        assert r.choices[0].message.model_extra["reasoning_content"] == REASONING


@pytest.mark.slow
def test_json_schema_applies_after_thinking(qwen3):
    """The reasoning is the script's free text (a grammar from the first token could not produce it); the answer
    is JSON valid under the schema, not the script's "Hello there"."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    reasoning, content, _ = whole(qwen3, response_format=fmt)
    assert reasoning == REASONING
    jsonschema.validate(json.loads(content), SCHEMA)
    assert streamed(qwen3, response_format=fmt)[:2] == (REASONING, content)
    # No thinking: the prompt ends the reasoning, so the grammar applies from the first token.
    reasoning, content2, _ = whole(qwen3, response_format=fmt,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning is None
    jsonschema.validate(json.loads(content2), SCHEMA)


@pytest.mark.slow
def test_forced_tool_call_is_parsed_after_reasoning(qwen3):
    tools = [{"type": "function", "function": {"name": "answer", "parameters": SCHEMA}}]
    choice = {"type": "function", "function": {"name": "answer"}}
    r = qwen3.chat.completions.create(model="test-model", messages=MESSAGES, temperature=0, max_tokens=40,
                                      tools=tools, tool_choice=choice)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == REASONING
    assert [c.function.name for c in msg.tool_calls] == ["answer"]
    args = msg.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(args), SCHEMA)
    reasoning, _, streamed_args, finish = streamed(qwen3, tools=tools, tool_choice=choice)
    assert (reasoning, streamed_args) == (REASONING, args)


@pytest.mark.slow
def test_auto_tool_choice_streams_the_answer_after_reasoning(qwen3):
    """tool_choice=auto: the script's answer has no call, so it streams as content, the reasoning apart."""
    tools = [{"type": "function", "function": {"name": "answer", "parameters": SCHEMA}}]
    reasoning, content, r = whole(qwen3, tools=tools)
    assert (reasoning, content, r.choices[0].message.tool_calls) == (REASONING, ANSWER, None)
    assert r.choices[0].finish_reason == "stop"
    assert streamed(qwen3, tools=tools) == (REASONING, ANSWER, "", "stop")


@pytest.mark.slow
def test_deepseek_r1_start_tag_in_the_prompt(model, tokenizer):
    srv, client = _server(model, "--reasoning-parser", "deepseek_r1")
    try:
        in_prompt = {"chat_template_kwargs": {"think_in_prompt": True}}  # R1's template opens <think>
        for kw in ({}, {"extra_body": in_prompt}):
            assert whole(client, **kw)[:2] == (REASONING, ANSWER)
            assert streamed(client, **kw)[:2] == (REASONING, ANSWER)
        # the raw text really lacks the start tag in that case (so the split is the parser's doing)
        r = client.completions.create(model="test-model", temperature=0, max_tokens=40, prompt=tokenizer.
                                      apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                                          think_in_prompt=True))
        assert r.choices[0].text == f"{REASONING}</think>{ANSWER}"
    finally:
        srv.stop()


@pytest.mark.slow
def test_gpt_oss_harmony_channels(model, tokenizer, tmp_path):
    template = tmp_path / "harmony.jinja"
    template.write_text(HARMONY_TEMPLATE)
    srv, client = _server(model, "--reasoning-parser", "gpt_oss", "--chat-template", str(template))
    try:
        reasoning, content, r = whole(client)
        assert (reasoning, content) == (HARMONY_REASONING, HARMONY_ANSWER)
        assert streamed(client)[:2] == (HARMONY_REASONING, HARMONY_ANSWER)
        # GPT-OSS's template reads reasoning_effort
        _, _, r2 = whole(client, reasoning_effort="medium")
        expect = tokenizer.apply_chat_template(MESSAGES, chat_template=HARMONY_TEMPLATE, add_generation_prompt=True,
                                               reasoning_effort="medium", tokenize=False)
        assert "Reasoning: medium" in expect
        assert r2.usage.prompt_tokens == len(tokenizer.encode(expect, add_special_tokens=False))
        assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    finally:
        srv.stop()


@pytest.mark.slow
def test_without_a_parser_the_text_is_untouched(model):
    srv, client = _server(model)
    try:
        r = client.chat.completions.create(model="test-model", messages=MESSAGES, temperature=0, max_tokens=40)
        msg = r.choices[0].message
        assert msg.content == f"<think>{REASONING}</think>{ANSWER}"
        assert "reasoning_content" not in (msg.model_extra or {})
        assert r.usage.completion_tokens_details is None
    finally:
        srv.stop()


def test_tool_calls_are_parsed_from_the_content_only():
    """A call the model only thinks about is no call; one in the answer is (hermes, tool_choice auto)."""
    from pagedllm.entrypoints.openai.serving_chat import ChatServing
    from pagedllm.reasoning import ReasoningStream, get_reasoning_parser
    from reasoning_models import reasoning_tokenizer

    chat = ChatServing.__new__(ChatServing)  # _message reads only the parser settings
    chat.tool_parser, chat.tokenizer = "hermes", None
    parser = get_reasoning_parser("qwen3", reasoning_tokenizer())
    call = '<tool_call>{"name": "answer", "arguments": {"answer": "yes"}}</tool_call>'
    msg, has_calls = chat._message(f"<think>maybe {call}</think>No call needed.", "auto", None,
                                  ReasoningStream(parser))
    assert not has_calls and msg["content"] == "No call needed." and msg["reasoning_content"] == f"maybe {call}"
    msg, has_calls = chat._message(f"<think>I will call it</think>{call}", "auto", None, ReasoningStream(parser))
    assert has_calls and msg["content"] is None and msg["reasoning"] == "I will call it"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("answer", {"answer": "yes"})]
    msg, has_calls = chat._message(f"<think>I will call it</think>{call}", "auto", None)  # no parser: as before
    assert has_calls and msg["content"] == "<think>I will call it</think>" and "reasoning" not in msg
