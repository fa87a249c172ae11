"""``mistral``: Mistral's calls after the ``[TOOL_CALLS]`` token, in any of its tokenizers' forms: a JSON array
``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v0.3), ``[TOOL_CALLS]name{...}`` (v11) and
``[TOOL_CALLS]name[ARGS]{...}`` (v13, optionally with ``[CALL_ID]id``), repeated for parallel calls. Call ids are
9 alphanumerics, as Mistral's chat templates require. ``[TOOL_CALLS]`` is a special token, so the request keeps
special tokens in its text (``adjust_request``)."""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (StreamedCall, ToolParser,
                                                                             ToolParserManager)
from pagedllm.entrypoints.openai.tool_parsers.records import ExtractedToolCallInformation
from pagedllm.entrypoints.openai.tool_parsers.utils import content_end, json_prefix, partial_json_call

_ALPHANUMERIC = string.ascii_letters + string.digits
_NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)")
_MARKERS = re.compile(r"\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?(?:\[ARGS\])?\s*")


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    bot_token = "[TOOL_CALLS]"
    call_format = 'write [TOOL_CALLS] followed by a JSON array of {"name": <function name>, "arguments": <object>}'

    @staticmethod
    def make_tool_call_id() -> str:
        return "".join(random.choices(_ALPHANUMERIC, k=9))

    def adjust_request(self, request: Any) -> Any:
        if getattr(request, "tools", None) and getattr(request, "tool_choice", None) != "none" \
                and getattr(request, "skip_special_tokens", False):
            request = request.model_copy(update={"skip_special_tokens": False})
        return request

    @staticmethod
    def _segment_calls(seg: str) -> list[tuple[str, Any]]:
        """(name, arguments) of the calls after one ``[TOOL_CALLS]``; ValueError unless the text is only calls."""
        s = seg.strip()
        if s.startswith("["):
            items = json.loads(s)
            if not isinstance(items, list) or not all(isinstance(it, dict) and isinstance(it.get("name"), str)
                                                      for it in items):
                raise ValueError("not a list of calls")
            return [(it["name"], it.get("arguments", {})) for it in items]
        calls, i, dec = [], 0, json.JSONDecoder()
        while i < len(s):
            m = _NAME.match(s, i)
            if m is None:
                raise ValueError("no function name")
            args, i = dec.raw_decode(s, _MARKERS.match(s, m.end()).end())
            calls.append((m.group(1), args))
            while i < len(s) and s[i] in " \n\t\r,":
                i += 1
        return calls

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        if self.bot_token not in model_output:
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        content, *segments = model_output.split(self.bot_token)
        try:
            found = [call for seg in segments for call in self._segment_calls(seg)]
        except ValueError:
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        if not found:
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        calls = [self.tool_call(name, json.dumps(args, ensure_ascii=False)) for name, args in found]
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content or None)

    @staticmethod
    def _partial_segment(seg: str) -> tuple[list[StreamedCall], bool]:
        """The calls of a segment as far as written, and False once something that is not a call shows."""
        calls: list[StreamedCall] = []
        i = len(seg) - len(seg.lstrip())
        if seg.startswith("[", i):
            i += 1
            while True:
                while i < len(seg) and seg[i] in " \n\t\r,":
                    i += 1
                if not seg.startswith("{", i):
                    return calls, True
                name, args, end = partial_json_call(seg, i)
                calls.append(StreamedCall(name, args))
                if end is None:
                    return calls, False
                i = end
        while i < len(seg):
            m = _NAME.match(seg, i)
            if m is None or m.end() == len(seg):
                return calls, False
            after = _MARKERS.match(seg, m.end()).end()
            if after == len(seg) or not seg.startswith("{", after):
                # "[ARGS" may still be arriving; anything else is not a name
                return calls, after == len(seg) or seg[after] == "["
            args, end = json_prefix(seg, after)
            calls.append(StreamedCall(m.group(1), args))
            if end is None:
                return calls, False
            i = end
            while i < len(seg) and seg[i] in " \n\t\r,":
                i += 1
        return calls, True

    def stream_view(self, text: str, request: Any) -> tuple[int, list[StreamedCall]]:
        calls: list[StreamedCall] = []
        for seg in text.split(self.bot_token)[1:]:
            found, ok = self._partial_segment(seg)
            calls += found
            if not ok or any(c.name is None for c in found):
                break
        return content_end(text, self.bot_token), calls
