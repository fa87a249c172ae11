"""The ``auto`` tool-call parsers (``tool_parsers/``, vLLM's ``ToolParser`` interface): each parser on vLLM's own
test strings (single call, parallel calls, text before the calls, malformed output returned unchanged), and its
streaming method fed the same text split at every character boundary, whose deltas add up to the whole-text parse.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional

import pytest

from pagedllm.entrypoints.openai import tool_calling as tc
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
    with pytest.raises(KeyError, match="tool parser 'nope' not found; registered: .*hermes"):
        ToolParserManager.get_tool_parser("nope")
    # the registry the reasoning parsers use too (pagedllm/parser_registry.py): lazy entries, refusals
    ToolParserManager.register_lazy_module("test_lazy", "pagedllm.entrypoints.openai.tool_parsers.hermes_tool_parser",
                                           "Hermes2ProToolParser")
    try:
        assert ToolParserManager.get_tool_parser("test_lazy").__name__ == "Hermes2ProToolParser"
        with pytest.raises(KeyError, match="'hermes' is already registered"):
            ToolParserManager.register_module("hermes", force=False, module=ToolParser)
        with pytest.raises(TypeError, match="subclass of ToolParser"):
            ToolParserManager.register_module("bad", module=int)
        assert "bad" not in ToolParserManager.list_registered()
    finally:
        ToolParserManager.tool_parsers.pop("test_lazy", None)
        ToolParserManager.lazy_parsers.pop("test_lazy", None)


def test_each_parser_describes_its_call_format_for_templates_without_tools():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    for name in ToolParserManager.list_registered():
        prompt = tc.tools_system_prompt(tools, name)
        fmt = ToolParserManager.get_tool_parser(name).call_format
        assert fmt and fmt in prompt and '"name": "add"' in prompt


def test_serve_cli_choices_come_from_the_registry():
    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", *args], capture_output=True,
                              text=True, timeout=120)

    help_text = serve("--help").stdout
    for name in ToolParserManager.list_registered():
        assert name in help_text
    bad = serve("some-model", "--tool-call-parser", "nope")
    assert bad.returncode == 2 and "--tool-call-parser" in bad.stderr and "invalid choice" in bad.stderr


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


# ---- mistral -----------------------------------------------------------------------------------------------
MISTRAL_TWO = ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 3.5, "b": 4}}, '
               '{"name": "get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", '
               '"unit": "celsius"}}]')


def test_mistral():
    assert parse("mistral", '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]') == (
        None, [("add", {"a": 3.5, "b": 4})], True)
    # vLLM's "argument_before_name_and_name_in_argument": the name is the top-level one
    assert parse("mistral", '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]') == (
        None, [("get_age", {"name": "John Doe"})], True)
    assert parse("mistral", MISTRAL_TWO)[1] == [("add", {"a": 3.5, "b": 4}), (
        "get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})]
    # the v11 and v13 forms, parallel calls as repeated [TOOL_CALLS], text before
    assert parse("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}') == (None, [("add", {"a": 3.5, "b": 4})], True)
    v13 = 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "SF"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'
    assert parse("mistral", v13) == ("Let me look.", [("get_weather", {"city": "SF"}), ("add", {"a": 1, "b": 2})],
                                     True)
    info = ToolParserManager.get_tool_parser("mistral")().extract_tool_calls(v13, None)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in info.tool_calls)  # Mistral's templates need these
    assert parse("mistral", "This is a test") == ("This is a test", [], False)
    bad = "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": "
    assert parse("mistral", bad) == (bad, [], False)
    for text in (MISTRAL_TWO, v13, '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]',
                 '[TOOL_CALLS]add{"a": 3.5, "b": 4}', "[TOOL_CALLS]{bad}", "This is a test"):
        check_stream("mistral", text)


def test_mistral_keeps_special_tokens_for_its_marker():
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                tools=[{"type": "function", "function": {"name": "add"}}])
    parser = ToolParserManager.get_tool_parser("mistral")()
    assert parser.adjust_request(req).skip_special_tokens is False and req.skip_special_tokens is True
    assert ToolParserManager.get_tool_parser("hermes")().adjust_request(req) is req


# ---- qwen3_coder -------------------------------------------------------------------------------------------
QWEN_TOOLS = [
    {"type": "function", "function": {"name": "get_current_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "state": {"type": "string"},
                                         "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]}}}}},
    {"type": "function", "function": {"name": "calculate_area", "parameters": {
        "type": "object", "properties": {"shape": {"type": "string"}, "dimensions": {"type": "object"},
                                         "precision": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "test_types", "parameters": {
        "type": "object", "properties": {"int_param": {"type": "integer"}, "float_param": {"type": "float"},
                                         "num_param": {"type": "number"}, "bool_param": {"type": "boolean"},
                                         "str_param": {"type": "string"}, "obj_param": {"type": "object"},
                                         "list_param": {"type": "array"}}}}},
]
QWEN_REQ = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=QWEN_TOOLS)
QWEN_WEATHER = ("<tool_call>\n<function=get_current_weather>\n<parameter=city>\n{city}\n</parameter>\n"
                "<parameter=state>\n{state}\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n"
                "</tool_call>")
QWEN_AREA = ("Let me calculate that area for you.<tool_call>\n<function=calculate_area>\n<parameter=shape>\n"
             "rectangle\n</parameter>\n<parameter=dimensions>\n{\"width\": 10, \n \"height\": 20}\n</parameter>\n"
             "<parameter=precision>\n2\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder():
    dallas = QWEN_WEATHER.format(city="Dallas", state="TX")
    weather = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
    assert parse("qwen3_coder", dallas, QWEN_REQ) == (None, [("get_current_weather", weather)], True)
    two = dallas + "\n" + QWEN_WEATHER.format(city="Orlando", state="FL")
    assert parse("qwen3_coder", two, QWEN_REQ)[1] == [
        ("get_current_weather", weather), ("get_current_weather", {**weather, "city": "Orlando", "state": "FL"})]
    assert parse("qwen3_coder", QWEN_AREA, QWEN_REQ) == (
        "Let me calculate that area for you.",
        [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2})],
        True)
    # no <tool_call> wrapper (vLLM's fallback), and values converted by the schema's types
    typed = ("<function=test_types>\n<parameter=int_param>\n42\n</parameter>\n<parameter=float_param>\n3.14\n"
             "</parameter>\n<parameter=num_param>\n2.0\n</parameter>\n<parameter=bool_param>\nTrue\n</parameter>\n"
             "<parameter=str_param>\nhello world\n</parameter>\n<parameter=obj_param>\n{\"key\": \"value\"}\n"
             "</parameter>\n<parameter=list_param>\n[1, 'a']\n</parameter>\n<parameter=extra>\nnull\n"
             "</parameter>\n</function>")
    assert parse("qwen3_coder", typed, QWEN_REQ)[1] == [("test_types", {
        "int_param": 42, "float_param": 3.14, "num_param": 2, "bool_param": True, "str_param": "hello world",
        "obj_param": {"key": "value"}, "list_param": [1, "a"], "extra": None})]
    # tools as plain dicts, flat as in the Responses API, convert the same
    flat = {"tools": [{"type": "function", **t["function"]} for t in QWEN_TOOLS]}
    assert parse("qwen3_coder", typed, flat)[1] == parse("qwen3_coder", typed, QWEN_REQ)[1]
    # without the request's tools every value stays text
    assert parse("qwen3_coder", dallas.replace("Dallas", "42"))[1] == [
        ("get_current_weather", {**weather, "city": "42"})]
    assert parse("qwen3_coder", "This is a test response without any tool calls") == (
        "This is a test response without any tool calls", [], False)
    bad = "Hmm <tool_call><function=get_current_weather</tool_call>"
    assert parse("qwen3_coder", bad, QWEN_REQ) == (bad, [], False)
    for text in (dallas, two, QWEN_AREA, typed, bad, "plain text"):
        check_stream("qwen3_coder", text, QWEN_REQ)


# ---- deepseek_v3 -------------------------------------------------------------------------------------------
DS_CALL = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>")
DS_TWO = ("<｜tool▁calls▁begin｜>" + DS_CALL.format(name="get_current_weather", args='{"location": "Beijing"}')
          + "\n" + DS_CALL.format(name="get_time", args='{\n  "tz": "Asia/Shanghai"\n}')
          + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>")


def test_deepseek_v3():
    one = "<｜tool▁calls▁begin｜>" + DS_CALL.format(name="add", args='{"a": 1, "b": 2}') + "<｜tool▁calls▁end｜>"
    assert parse("deepseek_v3", one) == (None, [("add", {"a": 1, "b": 2})], True)
    assert parse("deepseek_v3", DS_TWO)[1] == [("get_current_weather", {"location": "Beijing"}),
                                               ("get_time", {"tz": "Asia/Shanghai"})]
    # the arguments are the JSON text as written (vLLM's output)
    info = ToolParserManager.get_tool_parser("deepseek_v3")().extract_tool_calls(DS_TWO, None)
    assert info.tool_calls[1].function.arguments == '{\n  "tz": "Asia/Shanghai"\n}'
    assert parse("deepseek_v3", "Checking." + one)[0] == "Checking."
    bad = "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add {}<｜tool▁calls▁end｜>"
    assert parse("deepseek_v3", bad) == (bad, [], False)
    assert ToolParserManager.get_tool_parser("deepseekv3") is ToolParserManager.get_tool_parser("deepseek_v3")
    for text in (one, DS_TWO, "Checking." + one, bad, "no calls"):
        check_stream("deepseek_v3", text)


# ---- pythonic ----------------------------------------------------------------------------------------------
PY_TWO = ("[get_weather(city='San Francisco', metric='celsius'), "
          "register_user(name='Doe', age=-9, address={'city': 'SF', 'zip': (1, 2)}, "
          "role=None, passed_test=True, aliases=['John\\'s', \"J \\\"D\\\"\"], note='''a ) b''')]")


def test_pythonic():
    assert parse("pythonic", "[get_weather(city='San Francisco', metric='celsius')]") == (
        None, [("get_weather", {"city": "San Francisco", "metric": "celsius"})], True)
    assert parse("pythonic", PY_TWO)[1] == [
        ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
        ("register_user", {"name": "Doe", "age": -9, "address": {"city": "SF", "zip": [1, 2]}, "role": None,
                           "passed_test": True, "aliases": ["John's", 'J "D"'], "note": "a ) b"})]
    assert parse("pythonic", "[do_it()]") == (None, [("do_it", {})], True)
    # text before the list: the output is not calls (vLLM's rule: the whole output is the list)
    before = "Sure: [get_weather(city='SF')]"
    assert parse("pythonic", before) == (before, [], False)
    # never evaluated: anything but literal keyword arguments is content
    for bad in ("[__import__('os').system('x')]", "[f(x=open('y'))]", "[f('positional')]", "[1, 2]",
                "[get_weather(city='SF'"):
        assert parse("pythonic", bad) == (bad, [], False)
    for text in (PY_TWO, "[do_it()]", before, "[get_weather city='SF']", "[1, 2]", "plain text"):
        check_stream("pythonic", text)


def test_streaming_sends_names_before_arguments_end():
    """The name of a call goes out as soon as it is complete and the arguments grow as they settle, not only
    when the call ends."""
    parser = ToolParserManager.get_tool_parser("qwen3_coder")()
    text = QWEN_WEATHER.format(city="Dallas", state="TX")
    cut = text.index("<parameter=state>")
    parser.extract_tool_calls_streaming("", text[:cut], text[:cut], (), (), (), QWEN_REQ)
    delta = parser.extract_tool_calls_streaming(text[:cut], text[:cut + 1], text[cut], (), (), (), QWEN_REQ)
    assert delta is None
    first = ToolParserManager.get_tool_parser("qwen3_coder")().extract_tool_calls_streaming(
        "", text[:cut], text[:cut], (), (), (), QWEN_REQ)
    assert first.tool_calls[0].function.name == "get_current_weather"
    assert first.tool_calls[0].function.arguments == '{"city": "Dallas"'


@pytest.mark.parametrize("field", ["tool_call_parser", "reasoning_parser"])
def test_build_app_refuses_an_unknown_parser_before_serving(field):
    """A programmatic app with a parser name nothing registered fails when built, naming the argument and the
    parsers there are, not at the first request that needs the parser."""
    from pagedllm.entrypoints.openai.api_server import build_app

    with pytest.raises(ValueError, match=rf"^{field}: 'no-such-parser' is not a registered parser; available: .*hermes"
                       if field == "tool_call_parser" else rf"^{field}: 'no-such-parser' .*qwen3"):
        build_app(None, ["m"], **{field: "no-such-parser"})
