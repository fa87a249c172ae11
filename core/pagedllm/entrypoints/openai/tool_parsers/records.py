"""vLLM's tool-call records: what a parser returns for a whole output and for one streamed step.

``ToolCall`` and ``FunctionCall`` are the chat protocol's own (an assistant message's ``tool_calls`` entries), so a
parsed call serialises exactly as a client would send it back.
"""

from __future__ import annotations

import uuid
from typing import Optional

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol import FunctionCall, ToolCall

__all__ = ["DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "ExtractedToolCallInformation", "FunctionCall",
           "ToolCall", "make_tool_call_id"]


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


class ExtractedToolCallInformation(BaseModel):
    """A whole output: its calls and the text that is not a call (None when there is none)."""

    tools_called: bool
    tool_calls: list[ToolCall] = Field(default_factory=list)
    content: Optional[str] = None


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    """One streamed piece of call ``index``: the first carries id, type and the whole name; later ones only
    ``function.arguments`` fragments, whose concatenation is the call's arguments."""

    index: int
    id: Optional[str] = None
    type: Optional[str] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(BaseModel):
    """One streamed step of a chat choice (the ``delta`` of a chunk)."""

    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)
