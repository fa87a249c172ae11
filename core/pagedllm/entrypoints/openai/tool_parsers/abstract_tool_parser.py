"""vLLM's ``ToolParser`` interface and ``ToolParserManager`` registry.

A parser instance serves one chat choice (streaming keeps state on it). ``extract_tool_calls`` reads a whole
output. Streaming is one mechanism for every parser: a parser says what the text so far settles
(``stream_view``: how much is content for sure, and each call's name once complete and a prefix of its final
``arguments``), and the base class sends only what is new. ``finish_streaming`` (called when the choice ends)
sends what the final parse adds: the rest of the arguments, or, when the text held no valid call, the held-back
text as content. So the concatenated deltas of a stream equal ``extract_tool_calls`` of the whole text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

from pagedllm.entrypoints.openai.tool_parsers.records import (DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                                                ExtractedToolCallInformation, FunctionCall,
                                                                ToolCall, make_tool_call_id)
from pagedllm.parser_registry import ParserRegistry


@dataclass
class StreamedCall:
    """One call as far as the text settles it: ``name`` once complete (None: nothing to send yet) and a prefix of
    its final ``arguments``."""

    name: Optional[str]
    arguments: str = ""


class ToolParser:
    """Base class: subclasses implement ``extract_tool_calls`` and ``stream_view``."""

    #: how the model writes a call, for the system prompt of a chat template that does not render ``tools``
    call_format: str = ""

    def __init__(self, tokenizer: Any = None):
        self.model_tokenizer = tokenizer
        self.prev_tool_call_arr: list[dict] = []  # vLLM's names: what was streamed, per call
        self.current_tool_id: int = -1
        self.streamed_args_for_tool: list[str] = []
        self._content_sent = ""

    @cached_property
    def vocab(self) -> dict[str, int]:
        return self.model_tokenizer.get_vocab() if self.model_tokenizer is not None else {}

    def adjust_request(self, request: Any) -> Any:
        """Change the request before generation (e.g. keep the special tokens the parser looks for)."""
        return request

    @staticmethod
    def make_tool_call_id() -> str:
        return make_tool_call_id()

    def tool_call(self, name: str, arguments: str) -> ToolCall:
        return ToolCall(id=self.make_tool_call_id(), type="function",
                        function=FunctionCall(name=name, arguments=arguments))

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        raise NotImplementedError

    def stream_view(self, text: str, request: Any) -> tuple[int, list[StreamedCall]]:
        """(length of the leading content that is settled, the calls seen so far) for a partial output."""
        raise NotImplementedError

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> Optional[DeltaMessage]:
        end, calls = self.stream_view(current_text, request)
        return self._delta(current_text[:end], calls)

    def finish_streaming(self, current_text: str, request: Any) -> Optional[DeltaMessage]:
        """The last delta of a choice: what the final parse of the whole text adds to what was streamed."""
        info = self.extract_tool_calls(current_text, request)
        if not info.tools_called:
            return self._delta(current_text, [])
        return self._delta(info.content or "", [StreamedCall(c.function.name, c.function.arguments)
                                                for c in info.tool_calls])

    def _delta(self, content: str, calls: list[StreamedCall]) -> Optional[DeltaMessage]:
        new_content = None
        if len(content) > len(self._content_sent) and content.startswith(self._content_sent):
            new_content, self._content_sent = content[len(self._content_sent):], content
        deltas: list[DeltaToolCall] = []
        for i, call in enumerate(calls):
            if call.name is None:
                break
            if i == len(self.streamed_args_for_tool):  # a new call: id, type, whole name, arguments so far
                self.current_tool_id = i
                self.streamed_args_for_tool.append(call.arguments)
                self.prev_tool_call_arr.append({"name": call.name, "arguments": call.arguments})
                deltas.append(DeltaToolCall(index=i, id=self.make_tool_call_id(), type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                continue
            sent = self.streamed_args_for_tool[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self.streamed_args_for_tool[i] = self.prev_tool_call_arr[i]["arguments"] = call.arguments
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(
                    arguments=call.arguments[len(sent):])))
        if new_content is None and not deltas:
            return None
        return DeltaMessage(content=new_content, tool_calls=deltas)


class ToolParserManager(ParserRegistry):
    """The registry of tool-call parsers by name (vLLM's, ``--tool-call-parser``)."""

    kind, base = "tool parser", ToolParser
    tool_parsers = parsers = {}
    lazy_parsers = {}

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        return cls.get(name)
