"""Request bodies of the OpenAI API (plus vLLM's sampling extras), validated by pydantic.

Types, simple ranges and size bounds (stop strings, messages, request templates) are checked here so a wrong or
oversized field is a 400 naming it before any work; cross-field rules live in ``SamplingParams`` (its ParamError
names the field too). Unknown fields are ignored, as vLLM and OpenAI do.

Responses are built as plain dicts in the serving modules (streaming sends one JSON object per token, and pydantic
models per chunk would cost more than the tiny models' decode step); the response models below declare those shapes
on the routes, so ``/openapi.json`` is the real API (a test validates live responses against it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, StringConstraints

from pagedllm.entrypoints.limits import (
    MAX_MESSAGES,
    MAX_REQUEST_TEMPLATE_CHARS,
    MAX_STOP_STR_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from pagedllm.sampling_params import SamplingParams

StopStr = Annotated[StrictStr, StringConstraints(max_length=MAX_STOP_STR_LEN)]

Num = Union[StrictInt, float]  # floats; ints allowed, strings/bools rejected


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Sampling(_Base):
    """Fields shared by completions and chat; names are OpenAI's, extras are vLLM's."""

    model: Optional[StrictStr] = None
    n: Optional[StrictInt] = Field(1, ge=1, le=128)  # null (sent by some clients) means the default
    temperature: Optional[Num] = Field(None, ge=0, le=2)
    top_p: Optional[Num] = Field(None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(None, ge=-1)
    min_p: Optional[Num] = Field(None, ge=0, le=1)
    presence_penalty: Optional[Num] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[Num] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[Num] = Field(None, gt=0)
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StopStr, Annotated[list[StopStr], Field(max_length=MAX_STOP_STRINGS)]]] = None
    stop_token_ids: Optional[Annotated[list[StrictInt], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    ignore_eos: Optional[StrictBool] = False
    min_tokens: StrictInt = Field(0, ge=0)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None
    priority: StrictInt = 0
    return_token_ids: StrictBool = False  # vLLM extension: choices carry their (delta) token ids

    def sampling_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(n=self.n if self.n is not None else 1, seed=self.seed, stop=self.stop,
                                  stop_token_ids=self.stop_token_ids, ignore_eos=bool(self.ignore_eos),
                                  min_tokens=self.min_tokens,
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  skip_special_tokens=self.skip_special_tokens, priority=self.priority)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        return kw


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=1)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    echo: Optional[StrictBool] = False
    best_of: Optional[StrictInt] = Field(None, ge=1, le=128)
    suffix: Optional[StrictStr] = None

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, logprobs=self.logprobs, best_of=self.best_of,
                              **self.sampling_kwargs())


class ContentPart(_Base):
    type: StrictStr
    text: Optional[StrictStr] = None


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: Optional[Union[StrictStr, list[ContentPart]]] = None
    name: Optional[StrictStr] = None
    tool_call_id: Optional[StrictStr] = None

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # the text parts; HF chat templates take plain strings
            content = "".join(p.text or "" for p in content if p.type == "text")
        d: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: Optional[Annotated[StrictStr, StringConstraints(max_length=MAX_REQUEST_TEMPLATE_CHARS)]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

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
    tokens: list[StrictInt]


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


class UsageInfo(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
