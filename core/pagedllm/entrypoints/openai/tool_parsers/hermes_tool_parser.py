"""``hermes``: Hermes 2 Pro / Qwen 2.5+ calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
number, after optional text (the content, stripped). A call whose body is not a JSON object with a string ``name``
is skipped; an unclosed last call counts when its JSON is complete."""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (StreamedCall, ToolParser,
                                                                             ToolParserManager)
from pagedllm.entrypoints.openai.tool_parsers.records import ExtractedToolCallInformation
from pagedllm.entrypoints.openai.tool_parsers.utils import content_end, partial_json_call


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    tool_call_regex = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
    call_format = 'wrap each call as <tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>'

    @staticmethod
    def _call(body: str) -> Any:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            return obj
        return None

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        if self.tool_call_start_token not in model_output:
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        calls = [self.tool_call(o["name"], json.dumps(o.get("arguments", {}), ensure_ascii=False))
                 for o in map(self._call, self.tool_call_regex.findall(model_output)) if o is not None]
        if not calls:
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        content = model_output[:model_output.index(self.tool_call_start_token)].strip()
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content or None)

    def stream_view(self, text: str, request: Any) -> tuple[int, list[StreamedCall]]:
        calls: list[StreamedCall] = []
        start = text.find(self.tool_call_start_token)
        while start >= 0:
            body_start = start + len(self.tool_call_start_token)
            close = text.find(self.tool_call_end_token, body_start)
            if close < 0:  # the call being written
                pos = len(text) - len(text[body_start:].lstrip())
                name, args, _ = partial_json_call(text, pos)
                calls.append(StreamedCall(name, args))
                break
            obj = self._call(text[body_start:close].strip())
            if obj is not None:
                calls.append(StreamedCall(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
            start = text.find(self.tool_call_start_token, close)
        return content_end(text, self.tool_call_start_token), calls
