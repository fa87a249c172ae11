"""The ``auto`` tool-call parsers (``tool_parsers/``, vLLM's ``ToolParser`` interface): each parser on vLLM's own
test strings (single call, parallel calls, text before the calls, malformed output returned unchanged), and its
streaming method fed the same text split at every character boundary, whose deltas add up to the whole-text parse.
"""

from __future__ import annotations

import json
from typing import Optional

import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager

Calls = list[tuple[str, dict]]


def parse(name: str, text: str, request=None) -> tuple[Optional[str], Calls, bool]:
    info = ToolParserManager.get_tool_parser(name)().extract_tool_calls(text, request)
    assert all(c.type == "function" and c.id for c in info.tool_calls)
    assert info.tools_called == bool(info.tool_calls)
    return info.content, [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls], \
        info.tools_called


def stream(parser: ToolParser, text: str, request=None) -> tuple[str, list[tuple[str, str]], int]:
    """Feed ``text`` one character at a time, then end the choice: (content, [(name, arguments)], number of
    argument pieces sent before the end). Checks vLLM's delta rules: the first piece of a call carries id, type
    and the whole name; later ones only arguments."""
    content, calls, early = "", {}, 0

    def take(delta, final: bool) -> None:
        nonlocal content, early
        if delta is None:
            return
        assert delta.role is None
        content += delta.content or ""
        for d in delta.tool_calls:
            if d.index not in calls:
                assert d.index == len(calls) and d.id and d.type == "function" and d.function.name
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
            calls[d.index][1] += d.function.arguments or ""
            early += bool(d.function.arguments) and not final

    for i in range(len(text)):
        take(parser.extract_tool_calls_streaming(text[:i], text[:i + 1], text[i], (), (), (), request), False)
    take(parser.finish_streaming(text, request), True)
    return content, [(n, a) for _, (n, a) in sorted(calls.items())], early


def check_stream(name: str, text: str, request=None, streamed_early: bool = True) -> None:
    """Streaming ``text`` at every character boundary gives the whole-text parse: the same content (up to the
    whitespace a parser strips around it), the same names and the same arguments text."""
    info = ToolParserManager.get_tool_parser(name)().extract_tool_calls(text, request)
    content, calls, early = stream(ToolParserManager.get_tool_parser(name)(), text, request)
    assert (content.strip() or None) == (info.content.strip() if info.content else None)
    assert calls == [(c.function.name, c.function.arguments) for c in info.tool_calls]
    if streamed_early and info.tools_called:
        assert early > 0, "arguments were only sent at the end"


def test_registry_names_and_errors():
    names = ToolParserManager.list_registered()
    assert {"hermes", "llama3_json", "mistral", "qwen3_coder", "deepseek_v3", "pythonic"} <= set(names)
    with pytest.raises(KeyError, match="nope"):
        ToolParserManager.get_tool_parser("nope")


# ---- hermes ------------------------------------------------------------------------------------------------
HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
              '<tool_call>{"name": "echo", "arguments": {"text": "hi \\"there\\"", "n": [1.5e1, null]}}</tool_call>')


def test_hermes():
    assert parse("hermes", HERMES_TWO) == ("Let me check.", [("add", {"a": 1, "b": 2}),
                                                            ("echo", {"text": 'hi "there"', "n": [15.0, None]})],
                                           True)
    one = '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Dallas", "state": "TX"}}\n</tool_call>'
    assert parse("hermes", one) == (None, [("get_current_weather", {"city": "Dallas", "state": "TX"})], True)
    assert parse("hermes", "no call here") == ("no call here", [], False)
    bad = "text <tool_call>{not json}</tool_call>"
    assert parse("hermes", bad) == (bad, [], False)
    for text in (HERMES_TWO, one, bad, "text <tool_call", "plain text"):
        check_stream("hermes", text)


# ---- llama3_json -------------------------------------------------------------------------------------------
LLAMA_TWO = ('<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}; '
             '{"name": "echo", "parameters": {"text": "bye"}}')


def test_llama3_json():
    assert parse("llama3_json", LLAMA_TWO) == (None, [("add", {"a": 3, "b": 4}), ("echo", {"text": "bye"})], True)
    one = '{"name": "get_weather", "arguments": {"city": "SF", "days": [1, 2]}}'
    assert parse("llama3_json", one) == (None, [("get_weather", {"city": "SF", "days": [1, 2]})], True)
    # text before a call: Llama 3 calls are the whole output, so this is content
    before = 'Sure. {"name": "add", "parameters": {"a": 1}}'
    assert parse("llama3_json", before) == (before, [], False)
    assert parse("llama3_json", "The answer is 7.") == ("The answer is 7.", [], False)
    assert parse("llama3_json", '{"not": "a call"}') == ('{"not": "a call"}', [], False)
    for text in (LLAMA_TWO, one, before, '{"not": "a call"}', "The answer is 7."):
        check_stream("llama3_json", text)
