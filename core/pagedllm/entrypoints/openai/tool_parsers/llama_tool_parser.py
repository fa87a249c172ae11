"""``llama3_json``: Llama 3.1/3.2 JSON calls, ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), several
separated by ``;``, optionally after ``<|python_tag|>``. The whole output must be calls; anything else is
content."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (StreamedCall, ToolParser,
                                                                             ToolParserManager)
from pagedllm.entrypoints.openai.tool_parsers.records import ExtractedToolCallInformation
from pagedllm.entrypoints.openai.tool_parsers.utils import partial_json_call

_ARG_KEYS = ("parameters", "arguments")
_SEPARATORS = " \n\t\r;"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    bot_token = "<|python_tag|>"
    call_format = 'respond with a JSON object {"name": <function name>, "parameters": <arguments object>}'

    def _body_start(self, text: str) -> int:
        """Where the calls begin (after whitespace and the optional tag), or -1 when the text is not calls."""
        pos = len(text) - len(text.lstrip())
        if text.startswith(self.bot_token, pos):
            pos = len(text) - len(text[pos + len(self.bot_token):].lstrip())
        return pos if text.startswith("{", pos) else -1

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        i = self._body_start(model_output)
        not_calls = ExtractedToolCallInformation(tools_called=False, content=model_output)
        if i < 0:
            return not_calls
        calls = []
        dec = json.JSONDecoder()
        body = model_output.rstrip()
        while i < len(body):
            try:
                obj, i = dec.raw_decode(body, i)
            except ValueError:
                return not_calls
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return not_calls
            args = obj.get("parameters", obj.get("arguments", {}))
            calls.append(self.tool_call(obj["name"], json.dumps(args, ensure_ascii=False)))
            while i < len(body) and body[i] in _SEPARATORS:
                i += 1
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=None)

    def stream_view(self, text: str, request: Any) -> tuple[int, list[StreamedCall]]:
        s = text.lstrip()
        if not (s.startswith("{") or s.startswith(self.bot_token) or self.bot_token.startswith(s)):
            return len(text), []
        i = self._body_start(text)
        calls: list[StreamedCall] = []
        while 0 <= i < len(text):
            name, args, end = partial_json_call(text, i, _ARG_KEYS)
            calls.append(StreamedCall(name, args))
            if end is None:
                break
            i = end
            while i < len(text) and text[i] in _SEPARATORS:
                i += 1
            if not text.startswith("{", i):
                break
        return 0, calls
