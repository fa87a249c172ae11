"""Tool-call requests: validation, forced-choice grammars and the chat-template fallback for tools.

The ``auto`` parsers are tested in tests/core/test_tool_parsers.py. End-to-end tool calls through the server
(required, named, auto; streamed vs whole) are in test_structured_output_server.py and test_tool_parsers_server.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai import tool_calling as tc
from pagedllm.entrypoints.openai.protocol import ChatTool, NamedToolChoice
from pagedllm.entrypoints.openai.render_worker import render_chat_ids
from pagedllm.errors import ParamError
from server_utils import tiny_chat_model

ADD = ChatTool(type="function", function={"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"]}})
ECHO = ChatTool(type="function", function={"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"enum": ["hi", "bye"]}}, "required": ["text"]}})


def test_check_request_errors_name_the_field():
    named = NamedToolChoice(type="function", function={"name": "missing"})
    for tools, choice, field in (([], "required", "tool_choice"), ([ADD], named, "tool_choice"),
                                 ([ADD], "auto", "tool_choice")):
        with pytest.raises(ParamError) as e:
            tc.check_request(tools, choice, False, None, False)
        assert e.value.field == field
    assert tc.check_request([ADD], None, True, "hermes", False) == "auto"
    assert tc.check_request(None, None, False, None, False) == "none"


def test_forced_grammars_give_valid_calls_offline():
    """The grammars of ``required`` and a named choice, run on the random model: calls parse and validate."""
    llm = LLM(tiny_chat_model(), device="cpu", max_model_len=256, kv_cache_memory=32 << 20)
    schemas = {"add": ADD.function.parameters, "echo": ECHO.function.parameters}
    for choice in ("required", NamedToolChoice(type="function", function={"name": "echo"})):
        grammar = tc.forced_grammar([ADD, ECHO], choice, parallel=False)
        outs = llm.generate(["call:"], SamplingParams(temperature=1.0, n=4, seed=1, max_tokens=100,
                                                      structured_outputs=grammar), use_tqdm=False)[0].outputs
        for o in outs:
            calls = tc.forced_calls(o.text, choice)
            assert len(calls) == 1, o.text
            name, args = calls[0]
            jsonschema.validate(json.loads(args), schemas[name])
            if choice != "required":
                assert name == "echo"


def test_template_without_tools_gets_a_system_prompt():
    tok = AutoTokenizer.from_pretrained(tiny_chat_model())  # SmolLM2's template ignores `tools`
    tools = tc.tools_for_template([ADD])
    msgs = [{"role": "user", "content": "1+2?"}]
    prompt = tc.tools_system_prompt(tools, "hermes")
    ids = render_chat_ids(tok, msgs, None, True, False, None, 1 << 20, tools, prompt)
    text = tok.decode(ids)
    assert '"name": "add"' in text and "<tool_call>" in text and text.index("add") < text.index("1+2?")
    # a template that renders tools itself is used as is
    own = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
           "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    text = tok.decode(render_chat_ids(tok, msgs, own, True, False, None, 1 << 20, tools, prompt))
    assert text.startswith("TOOL add\n") and "<tool_call>" not in text
