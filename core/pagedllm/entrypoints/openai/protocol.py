"""Request bodies of the OpenAI API (plus vLLM's sampling extras), validated by pydantic.

Types, simple ranges and size bounds (stop strings, messages, request templates) are checked here so a wrong or
oversized field is a 400 naming it before any work; cross-field rules live in ``SamplingParams`` (its ParamError
names the field too). Fields a model does not declare are kept (``model_extra``) so the serving layer can refuse
the OpenAI fields pagedllm does not implement (400 naming them) and log the rest (``extra_fields.py``).

Responses are built as plain dicts in the serving modules (streaming sends one JSON object per token, and pydantic
models per chunk would cost more than the tiny models' decode step); the response models below declare those shapes
on the routes, so ``/openapi.json`` is the real API (a test validates live responses against it).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictBool, StrictInt, StrictStr, StringConstraints

from pagedllm.entrypoints.openai.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_REQUEST_TEMPLATE_CHARS,
    MAX_STOP_STR_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
)
from pagedllm.errors import ParamError
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

StopStr = Annotated[StrictStr, StringConstraints(max_length=MAX_STOP_STR_LEN)]

Num = Union[StrictInt, FiniteFloat]  # floats; ints allowed, strings/bools, NaN and +-Infinity rejected
#: Every integer a request carries fits the engine's 64-bit fields (torch's seeds, tensors of ids); a token id or a
#: count fits 32 bits. Python's ints are unbounded, so an unbounded field would reach torch as an overflow (a 500).
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
Int32 = Annotated[StrictInt, Field(ge=-(1 << 31), le=(1 << 31) - 1)]
INT32_MAX = (1 << 31) - 1


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # see extra_fields.py: refused or logged, never silently dropped


class JSONSchemaFormat(_Base):
    name: Annotated[StrictStr, StringConstraints(max_length=64)] = "response"
    description: Optional[StrictStr] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class StructuredOutputsRequest(_Base):
    """vLLM's ``structured_outputs`` request field (one of these)."""

    json_: Optional[Union[dict[str, Any], StrictStr]] = Field(None, alias="json")
    regex: Optional[StrictStr] = None
    choice: Optional[list[StrictStr]] = None
    grammar: Optional[StrictStr] = None
    json_object: Optional[StrictBool] = None


class StreamOptions(_Base):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Sampling(_Request):
    """Fields shared by completions and chat; names are OpenAI's, extras are vLLM's."""

    model: Optional[StrictStr] = None
    n: Optional[StrictInt] = Field(1, ge=1, le=128)  # null (sent by some clients) means the default
    temperature: Optional[Num] = Field(None, ge=0, le=2)
    top_p: Optional[Num] = Field(None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(None, ge=-1, le=INT32_MAX)
    min_p: Optional[Num] = Field(None, ge=0, le=1)
    presence_penalty: Optional[Num] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[Num] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[Num] = Field(None, gt=0)
    seed: Optional[StrictInt] = Field(None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's range; n > 1 adds the index
    stop: Optional[Union[StopStr, Annotated[list[StopStr], Field(max_length=MAX_STOP_STRINGS)]]] = None
    stop_token_ids: Optional[Annotated[list[Int32], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    ignore_eos: Optional[StrictBool] = False
    min_tokens: StrictInt = Field(0, ge=0, le=INT32_MAX)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None
    priority: StrictInt = Field(0, ge=INT64_MIN, le=INT64_MAX)
    return_token_ids: StrictBool = False  # vLLM extension: choices carry their (delta) token ids
    spaces_between_special_tokens: StrictBool = True
    logit_bias: Optional[Annotated[dict[StrictStr, Num], Field(max_length=MAX_LOGIT_BIAS)]] = None
    allowed_token_ids: Optional[Annotated[list[Int32],
                                          Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)]] = None
    bad_words: Optional[Annotated[list[StopStr], Field(max_length=MAX_STOP_STRINGS)]] = None
    truncate_prompt_tokens: Optional[StrictInt] = Field(None, ge=1, le=INT32_MAX)
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Optional[Union[dict[str, Any], StrictStr]] = None  # vLLM's older names
    guided_regex: Optional[StrictStr] = None
    guided_choice: Optional[list[StrictStr]] = None
    guided_grammar: Optional[StrictStr] = None
    kv_transfer_params: Optional[dict[str, Any]] = None  # vLLM's: a KV connector's P/D hand-off (docs/kv-offload.md)

    def structured(self) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
        """The request's constraint and the field that set it (None, None when unconstrained)."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", dict(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ParamError("response_format", "type json_schema needs json_schema.schema")
            found.append(("response_format", dict(json=rf.json_schema.schema_)))
        so = self.structured_outputs
        if so is not None:
            found.append(("structured_outputs", dict(json=so.json_, regex=so.regex, choice=so.choice,
                                                     grammar=so.grammar, json_object=so.json_object)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        if not found:
            return None, None
        if len(found) > 1:
            raise ParamError(found[1][0], f"only one of response_format, structured_outputs and guided_* may "
                                          f"constrain a request; got {', '.join(f for f, _ in found)}")
        name, kw = found[0]
        try:
            return StructuredOutputsParams(**kw), name
        except ParamError as e:
            raise ParamError(name, e.message) from None

    def sampling_kwargs(self) -> dict[str, Any]:
        bias = None
        if self.logit_bias is not None:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = v
                except ValueError:
                    raise ParamError("logit_bias", f"keys must be token ids (integers as strings), got {k!r}") from None
        kw: dict[str, Any] = dict(n=self.n if self.n is not None else 1, seed=self.seed, stop=self.stop,
                                  stop_token_ids=self.stop_token_ids, ignore_eos=bool(self.ignore_eos),
                                  min_tokens=self.min_tokens,
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  skip_special_tokens=self.skip_special_tokens, priority=self.priority,
                                  spaces_between_special_tokens=self.spaces_between_special_tokens,
                                  logit_bias=bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                                  truncate_prompt_tokens=self.truncate_prompt_tokens,
                                  structured_outputs=self.structured()[0])
        if self.kv_transfer_params is not None:
            kw["extra_args"] = {"kv_transfer_params": self.kv_transfer_params}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        return kw


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[Int32], list[StrictStr], list[list[Int32]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=1, le=INT32_MAX)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    echo: Optional[StrictBool] = False
    best_of: Optional[StrictInt] = Field(None, ge=1, le=128)
    suffix: Optional[StrictStr] = None

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, logprobs=self.logprobs, best_of=self.best_of,
                              **self.sampling_kwargs())


class ImageURL(_Base):
    url: StrictStr
    detail: Optional[Literal["auto", "low", "high"]] = None


class ContentPart(_Base):
    """One part of a message's content; which types are taken (text, images) and for which model is decided by
    ``multimodal.content_parts.parse_chat_messages``, which names the part it refuses."""

    type: StrictStr
    text: Optional[StrictStr] = None
    refusal: Optional[StrictStr] = None
    image_url: Optional[Union[StrictStr, ImageURL]] = None  # chat: {"url": ...}; input_image: the URL itself
    detail: Optional[StrictStr] = None
    file_id: Optional[StrictStr] = None


class FunctionCall(_Base):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Base):
    id: Optional[StrictStr] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: Optional[Union[StrictStr, list[ContentPart]]] = None
    name: Optional[StrictStr] = None
    tool_call_id: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCall]] = None
    # an earlier answer's reasoning sent back (vLLM's two names); templates read ``reasoning_content`` (Qwen3's)
    reasoning_content: Optional[StrictStr] = None
    reasoning: Optional[StrictStr] = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as a chat-template dict; a part list stays OpenAI's parts, for ``parse_chat_messages``."""
        content: Any = self.content
        if isinstance(content, list):
            content = [p.model_dump(exclude_none=True) for p in content]
        d: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None:
            d["reasoning_content"] = d["reasoning"] = thought
        if self.tool_calls:  # HF templates take the arguments as a dict
            d["tool_calls"] = [{"id": t.id, "type": "function", "function": {
                "name": t.function.name, "arguments": _json_or_text(t.function.arguments)}} for t in self.tool_calls]
        return d


def _json_or_text(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        return s


class FunctionDefinition(_Base):
    name: Annotated[StrictStr, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class ChatTool(_Base):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Base):
    name: StrictStr


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Optional[StrictInt] = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1, le=INT32_MAX)
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: Optional[Annotated[StrictStr, StringConstraints(max_length=MAX_REQUEST_TEMPLATE_CHARS)]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    # OpenAI's field; rendered as the template variable ``reasoning_effort`` (GPT-OSS's template reads it)
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    include_reasoning: StrictBool = True  # vLLM's: false drops the reasoning (--reasoning-parser) from the response

    def template_kwargs(self) -> Optional[dict[str, Any]]:
        """``chat_template_kwargs`` plus ``reasoning_effort`` (a value in the kwargs wins, as it is explicit)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self) -> SamplingParams:
        lp = None
        if self.logprobs:
            lp = self.top_logprobs or 0
        return SamplingParams(max_tokens=self.max_new_tokens, logprobs=lp, **self.sampling_kwargs())


class TokenizeRequest(_Base):
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]] = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Base):
    model: Optional[StrictStr] = None
    tokens: list[Int32]


# ---- responses (declared on the routes; the handlers build the same shapes as plain dicts) -----------------------
class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorInfo(_Out):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(_Out):
    error: ErrorInfo


class CompletionTokensDetails(_Out):
    reasoning_tokens: int


class UsageInfo(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: Optional[CompletionTokensDetails] = None  # chat, with a reasoning parser


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None
    prompt_token_ids: Optional[list[int]] = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class TopLogprob(_Out):
    token: str
    logprob: Optional[float] = None
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: Optional[list[TokenLogprob]] = None


class ChatResponseMessage(_Out):
    role: str
    content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    # with --reasoning-parser: the reasoning, under vLLM's current name and its older one (same value)
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatCompletionChoice(_Out):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(_Out):
    prompt: str


class VersionResponse(_Out):
    version: str


class LoadLoRAAdapterRequest(_Base):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoRAAdapterRequest(_Base):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    lora_name: StrictStr
    lora_int_id: Optional[Int64] = None
