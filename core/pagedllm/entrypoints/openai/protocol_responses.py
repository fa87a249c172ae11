"""Request body of ``POST /v1/responses`` (OpenAI's Responses API as vLLM serves it) and its input items.

The request is validated by pydantic like the other endpoints (a wrong type or range is a 400 naming the field).
``input`` items are checked one by one in :func:`parse_input` so an error names the item (``input[2].content``) and
an unsupported kind (an image, a file, an item reference) is refused by name instead of being dropped. Built-in
tools (web search, file search, code interpreter, ...), ``background`` and other fields pagedllm cannot honour are
400s naming the field (``unsupported_fields``), never ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, FiniteFloat, StrictBool, StrictInt, StrictStr, StringConstraints,
                      ValidationError)

from pagedllm.entrypoints.openai.limits import INT64_MAX, INT64_MIN, MAX_MESSAGES, MAX_TOOLS
from pagedllm.entrypoints.openai.protocol import INT32_MAX, ChatTool, NamedToolChoice
from pagedllm.errors import ParamError
from pagedllm.sampling_params import StructuredOutputsParams

Num = Union[StrictInt, FiniteFloat]


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: refused or logged (extra_fields.py)


class FunctionTool(_Item):
    """A Responses function tool: the chat tool's ``function`` fields, flattened."""

    type: Literal["function"]
    name: Annotated[StrictStr, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None

    def to_chat_tool(self) -> ChatTool:
        return ChatTool(type="function", function={"name": self.name, "description": self.description,
                                                   "parameters": self.parameters, "strict": self.strict})


class FunctionToolChoice(_Item):
    type: Literal["function"]
    name: StrictStr


class TextFormat(_Item):
    """``text.format``: ``text`` (default), ``json_object`` or ``json_schema`` (-> structured outputs)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[Annotated[StrictStr, StringConstraints(max_length=64)]] = None
    description: Optional[StrictStr] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[StrictBool] = None


class TextConfig(_Item):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ReasoningConfig(_Item):
    effort: Optional[Literal["minimal", "low", "medium", "high"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesRequest(_Request):
    """The fields pagedllm serves; anything else is refused (400 naming it) or, if harmless, logged."""

    model: Optional[StrictStr] = None
    input: Union[StrictStr, Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]]
    instructions: Optional[StrictStr] = None
    max_output_tokens: Optional[StrictInt] = Field(None, ge=1, le=INT32_MAX)
    temperature: Optional[Num] = Field(None, ge=0, le=2)
    top_p: Optional[Num] = Field(None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(None, ge=-1, le=INT32_MAX)  # vLLM's extras
    min_p: Optional[Num] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[Num] = Field(None, gt=0)
    seed: Optional[StrictInt] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    tools: Optional[Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionToolChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    stream: Optional[StrictBool] = False
    store: Optional[StrictBool] = True
    previous_response_id: Optional[StrictStr] = None
    metadata: Optional[Annotated[dict[StrictStr, StrictStr], Field(max_length=16)]] = None
    user: Optional[StrictStr] = None
    background: Optional[StrictBool] = False
    truncation: Optional[Literal["auto", "disabled"]] = None
    include: Optional[list[StrictStr]] = None
    priority: StrictInt = Field(0, ge=INT64_MIN, le=INT64_MAX)

    def function_tools(self) -> list[FunctionTool]:
        """The ``tools`` as function tools; a built-in tool is a 400 naming ``tools``."""
        out = []
        for i, t in enumerate(self.tools or []):
            kind = t.get("type")
            if kind != "function":
                raise ParamError("tools", f"tools[{i}]: built-in tool type {kind!r} is not supported by this "
                                          "server; only function tools are")
            try:
                out.append(FunctionTool.model_validate(t))
            except ValidationError as e:
                raise ParamError("tools", f"tools[{i}]: {_first(e)}") from None
        return out

    def chat_tool_choice(self) -> Any:
        """``tool_choice`` in chat's terms (a named choice becomes chat's ``NamedToolChoice``)."""
        c = self.tool_choice
        if isinstance(c, FunctionToolChoice):
            return NamedToolChoice(type="function", function={"name": c.name})
        return c

    def structured(self) -> Optional[StructuredOutputsParams]:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.schema_ is None:
            raise ParamError("text.format", "type json_schema needs schema")
        try:
            return StructuredOutputsParams(json=fmt.schema_)
        except ParamError as e:
            raise ParamError("text.format", e.message) from None


#: Request fields pagedllm cannot honour: 400 naming them (checked on the declared fields and the extras).
UNSUPPORTED: dict[str, str] = {
    "background": "background responses are not supported; send the request without background",
    "conversation": "conversations are not supported; chain responses with previous_response_id",
    "prompt": "prompt templates are not supported; send input and instructions",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "max_tool_calls is not supported",
    "stream_options": "stream_options is not supported on /v1/responses",
    "context_management": "context management is not supported",
    "prompt_cache_retention": "not supported",
}

#: ``include`` values are extra output (logprobs, encrypted reasoning, search results) pagedllm does not produce.
SUPPORTED_INCLUDE: frozenset[str] = frozenset()


def unsupported_fields(req: ResponsesRequest) -> None:
    """ParamError naming the first field the request sets that pagedllm cannot honour."""
    if req.background:
        raise ParamError("background", UNSUPPORTED["background"])
    if req.truncation == "auto":
        raise ParamError("truncation", '"auto" (dropping input to fit) is not supported; use "disabled"')
    for value in req.include or []:
        if value not in SUPPORTED_INCLUDE:
            raise ParamError("include", f"{value!r} is not supported")
    for name, value in (req.model_extra or {}).items():
        if name in UNSUPPORTED and value is not None and value is not False:
            raise ParamError(name, UNSUPPORTED[name])


def _first(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return f"{loc}: {err.get('msg', 'invalid value')}" if loc else err.get("msg", "invalid value")


# ---- input items ---------------------------------------------------------------------------------------------
_TEXT_PARTS = {"input_text", "output_text", "text"}
_REFUSED_PARTS = {"input_image": "image input is not supported here", "input_file": "file input is not supported",
                  "input_audio": "audio input is not supported", "refusal": None}


class MessagePart(_Item):
    type: StrictStr
    text: Optional[StrictStr] = None
    refusal: Optional[StrictStr] = None
    image_url: Optional[StrictStr] = None  # input_image (a URL or a data: URL)
    detail: Optional[StrictStr] = None
    file_id: Optional[StrictStr] = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[StrictStr, list[MessagePart]]
    id: Optional[StrictStr] = None
    status: Optional[StrictStr] = None


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: Optional[StrictStr] = None
    status: Optional[StrictStr] = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: Union[StrictStr, list[MessagePart]]
    id: Optional[StrictStr] = None
    status: Optional[StrictStr] = None


class ReasoningText(_Item):
    type: StrictStr
    text: StrictStr


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    id: Optional[StrictStr] = None
    summary: list[ReasoningText] = []
    content: Optional[list[ReasoningText]] = None
    encrypted_content: Optional[StrictStr] = None


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
_KINDS: dict[str, type] = {"message": MessageItem, "function_call": FunctionCallItem,
                           "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


def _content_of(parts: Union[str, list[MessagePart]], where: str) -> Union[str, list[dict[str, Any]]]:
    """A message's content: its text, or, when it holds images, chat parts (``input_image`` parts carry their
    request path in ``_field``; ``multimodal.content_parts`` checks and loads them like chat's)."""
    if isinstance(parts, str) or not any(p.type == "input_image" for p in parts):
        return _text_of(parts, where)
    return [{**p.model_dump(exclude_none=True), "_field": f"{where}.content[{j}]"} if p.type == "input_image"
            else {"type": "text", "text": _part_text(p, f"{where}.content[{j}]")} for j, p in enumerate(parts)]


def _text_of(parts: Union[str, list[MessagePart]], where: str) -> str:
    if isinstance(parts, str):
        return parts
    return "".join(_part_text(p, f"{where}.content[{j}]") for j, p in enumerate(parts))


def _part_text(p: MessagePart, where: str) -> str:
    if p.type in _TEXT_PARTS:
        return p.text or ""
    if p.type == "refusal":
        return p.refusal or ""
    why = _REFUSED_PARTS.get(p.type) or "only text parts are supported"
    raise ParamError("input", f"{where}: type {p.type!r}: {why}")


def parse_input(value: Union[str, list[dict[str, Any]]]) -> list[InputItem]:
    """``input`` as typed items (a string is one user message); errors name ``input[i]``."""
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    items: list[InputItem] = []
    for i, raw in enumerate(value):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        model = _KINDS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise ParamError("input", f"input[{i}]: item type {kind!r} is not supported (message, function_call, "
                                      "function_call_output and reasoning are)")
        try:
            item = model.model_validate(raw)
        except ValidationError as e:
            raise ParamError("input", f"input[{i}]: {_first(e)}") from None
        if isinstance(item, MessageItem):
            _content_of(item.content, f"input[{i}]")
        elif isinstance(item, FunctionCallOutputItem):
            _text_of(item.output, f"input[{i}]")
        items.append(item)
    return items


def to_chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat-template messages (what /v1/chat/completions renders): a ``function_call`` joins the
    assistant turn before it as a tool call, its ``function_call_output`` is a ``tool`` message, and a reasoning
    item becomes the next assistant message's ``reasoning_content``."""
    out: list[dict[str, Any]] = []
    reasoning: Optional[str] = None
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            parts = item.content or item.summary
            reasoning = "".join(p.text for p in parts)
            continue
        if isinstance(item, MessageItem):
            msg: dict[str, Any] = {"role": item.role, "content": _content_of(item.content, f"input[{i}]")}
            if item.role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif isinstance(item, FunctionCallItem):
            try:
                args: Any = json.loads(item.arguments)
            except ValueError:
                args = item.arguments
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": args}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text_of(item.output, "input")})
    return out


# ---- responses (declared on the routes; the handlers build the same shapes as plain dicts) -----------------------
class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponsesResponse(_Out):
    """OpenAI's ``Response`` object (``output`` items: message, reasoning, function_call)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "cancelled", "queued"]
    model: str
    output: list[dict[str, Any]]
    usage: Optional[ResponseUsage] = None
    previous_response_id: Optional[str] = None
    instructions: Optional[str] = None
    incomplete_details: Optional[dict[str, Any]] = None
    error: Optional[dict[str, Any]] = None


class ResponseDeleted(_Out):
    id: str
    object: Literal["response.deleted"]
    deleted: bool
