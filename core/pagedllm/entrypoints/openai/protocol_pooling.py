"""Request and response bodies of the pooling endpoints (vLLM's names and shapes).

``/v1/embeddings`` is OpenAI's (``input``, ``encoding_format``, ``dimensions``, ``user``) plus vLLM's extras
(``truncate_prompt_tokens``, ``add_special_tokens``, ``normalize``, chat-style ``messages``); ``/score`` is vLLM's
(``text_1``, ``text_2``); ``/rerank`` is Jina's and Cohere's (``query``, ``documents``, ``top_n``,
``return_documents``); ``/classify`` and ``/pooling`` are vLLM's. Types and size bounds are checked here, so a wrong
field is a 400 naming it; which model may serve which route is the serving layer's check.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, StringConstraints

from pagedllm.entrypoints.openai.limits import INT64_MAX, INT64_MIN, MAX_MESSAGES, MAX_REQUEST_TEMPLATE_CHARS
from pagedllm.entrypoints.openai.protocol import ChatMessage, Int32

#: Most inputs one request may carry (OpenAI's bound on an embeddings batch).
MAX_POOLING_INPUTS = 2048

#: One input: text, or token ids (OpenAI's embeddings ``input``); a batch of either.
PoolingInput = Union[StrictStr, Annotated[list[Int32], Field(min_length=1)],
                     Annotated[list[StrictStr], Field(max_length=MAX_POOLING_INPUTS)],
                     Annotated[list[Annotated[list[Int32], Field(min_length=1)]],
                               Field(max_length=MAX_POOLING_INPUTS)]]
ScoreText = Union[StrictStr, Annotated[list[StrictStr], Field(max_length=MAX_POOLING_INPUTS)]]


class _PoolingBase(BaseModel):
    """Fields every pooling request shares; unknown fields are kept for ``extra_fields.py`` (refused or logged)."""

    model_config = ConfigDict(extra="allow")

    model: Optional[StrictStr] = None
    user: Optional[StrictStr] = None
    truncate_prompt_tokens: Optional[StrictInt] = Field(None, ge=1, le=(1 << 31) - 1)
    priority: StrictInt = Field(0, ge=INT64_MIN, le=INT64_MAX)


class _TextInput(_PoolingBase):
    """``input`` (text, ids, or a batch) or chat ``messages`` rendered with the chat template (vLLM's chat form)."""

    input: Optional[PoolingInput] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]] = None
    add_special_tokens: Optional[StrictBool] = None  # input only (default True); messages: the template has them
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: Optional[Annotated[StrictStr, StringConstraints(max_length=MAX_REQUEST_TEMPLATE_CHARS)]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class EmbeddingRequest(_TextInput):
    """``POST /v1/embeddings``."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[StrictInt] = Field(None, ge=1, le=(1 << 31) - 1)
    normalize: Optional[StrictBool] = None


class PoolingRequest(EmbeddingRequest):
    """``POST /pooling``: the pooler's raw output (vLLM's); ``task`` picks the pooler (default: the model's)."""

    task: Optional[Literal["embed", "classify", "score", "reward", "encode"]] = None


class ClassificationRequest(_TextInput):
    """``POST /classify``."""

    use_activation: Optional[StrictBool] = None  # softmax (sigmoid for one label); False: raw logits


class ScoreRequest(_PoolingBase):
    """``POST /score``: ``text_1`` against ``text_2``, 1-to-1, 1-to-N (``text_1`` one text) or N-to-N pairwise."""

    text_1: ScoreText
    text_2: ScoreText
    use_activation: Optional[StrictBool] = None


class RerankRequest(_PoolingBase):
    """``POST /rerank`` (``/v1/rerank``, ``/v2/rerank``): Jina's and Cohere's body."""

    query: StrictStr
    documents: Annotated[list[StrictStr], Field(max_length=MAX_POOLING_INPUTS)]
    top_n: Optional[StrictInt] = Field(None, ge=0, le=MAX_POOLING_INPUTS)  # 0 or absent: every document
    return_documents: StrictBool = True
    use_activation: Optional[StrictBool] = None


# ---- responses (declared on the routes; the handlers build the same shapes as plain dicts) -----------------------
class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class PoolingUsage(_Out):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingData(_Out):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], str]  # a base64 string with encoding_format "base64"


class EmbeddingResponse(_Out):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(_Out):
    index: int
    object: Literal["pooling"] = "pooling"
    data: Union[list[list[float]], list[float], str]


class PoolingResponse(_Out):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ClassificationData(_Out):
    index: int
    label: Optional[str] = None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_Out):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreData(_Out):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_Out):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(_Out):
    text: str


class RerankResult(_Out):
    index: int
    relevance_score: float
    document: Optional[RerankDocument] = None


class RerankUsage(_Out):
    total_tokens: int
    prompt_tokens: Optional[int] = None


class RerankResponse(_Out):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
