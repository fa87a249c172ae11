"""``deepseek_v3``: DeepSeek-V3's calls between special tokens,
``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...
<｜tool▁calls▁end｜>``, after optional content. As in vLLM, ``arguments`` is the JSON text exactly as written."""

from __future__ import annotations

import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (StreamedCall, ToolParser,
                                                                             ToolParserManager)
from pagedllm.entrypoints.openai.tool_parsers.records import ExtractedToolCallInformation
from pagedllm.entrypoints.openai.tool_parsers.utils import content_end, held_suffix


@ToolParserManager.register_module(["deepseek_v3", "deepseekv3"])
class DeepSeekV3ToolParser(ToolParser):
    tool_calls_start_token = "<｜tool▁calls▁begin｜>"
    tool_calls_end_token = "<｜tool▁calls▁end｜>"
    tool_call_start_token = "<｜tool▁call▁begin｜>"
    tool_call_end_token = "<｜tool▁call▁end｜>"
    tool_sep_token = "<｜tool▁sep｜>"
    args_open = "\n```json\n"
    args_close = "\n```<｜tool▁call▁end｜>"
    tool_call_regex = re.compile(r"<｜tool▁call▁begin｜>(?P<type>[^\n]*?)<｜tool▁sep｜>(?P<function_name>[^\n]*?)"
                                 r"\n```json\n(?P<function_arguments>.*?)\n```<｜tool▁call▁end｜>", re.S)
    call_format = ("write <｜tool▁calls▁begin｜>, then each call as <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n"
                   "```json\n<arguments object>\n```<｜tool▁call▁end｜>, then <｜tool▁calls▁end｜>")

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        start = model_output.find(self.tool_calls_start_token)
        calls = [self.tool_call(m.group("function_name"), m.group("function_arguments"))
                 for m in self.tool_call_regex.finditer(model_output, max(start, 0))] if start >= 0 else []
        if not calls:
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls,
                                            content=model_output[:start] or None)

    def stream_view(self, text: str, request: Any) -> tuple[int, list[StreamedCall]]:
        end = content_end(text, self.tool_calls_start_token)
        calls: list[StreamedCall] = []
        pos = text.find(self.tool_call_start_token, end) if end < len(text) else -1
        while pos >= 0:
            sep = text.find(self.tool_sep_token, pos)
            newline = text.find("\n", sep) if sep >= 0 else -1
            if newline < 0:
                break  # the name is still being written
            name = text[sep + len(self.tool_sep_token):newline]
            if not text.startswith(self.args_open, newline):
                if self.args_open.startswith(text[newline:]):
                    calls.append(StreamedCall(name))
                break
            args_start = newline + len(self.args_open)
            close = text.find(self.args_close, args_start)
            if close < 0:
                args = text[args_start:]
                calls.append(StreamedCall(name, args[:len(args) - held_suffix(args, self.args_close)]))
                break
            calls.append(StreamedCall(name, text[args_start:close]))
            pos = text.find(self.tool_call_start_token, close)
        return end, calls
