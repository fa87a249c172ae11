"""What generate() returns, with vLLM's class and field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[object] = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[list] = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    kv_transfer_params: Optional[dict] = None  # a KV connector's, for the next instance (P/D disaggregation)


# ---- pooling (embed / classify / score / reward / encode), vLLM's classes -------------------------------------------
@dataclass
class PoolingOutput:
    """The pooled tensor of one prompt (on the host, float32): ``[hidden]`` / ``[num_labels]`` / ``[tokens, ...]``."""

    data: "torch.Tensor"


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> "EmbeddingOutput":
        if output.data.ndim != 1:
            raise ValueError("pooled data should be a 1-D embedding vector")
        return EmbeddingOutput(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> "ClassificationOutput":
        if output.data.ndim != 1:
            raise ValueError("pooled data should be a 1-D probability vector")
        return ClassificationOutput(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @staticmethod
    def from_base(output: PoolingOutput) -> "ScoringOutput":
        if output.data.numel() != 1:
            raise ValueError(f"a score is one number; the pooled data has shape {tuple(output.data.shape)}")
        return ScoringOutput(float(output.data.reshape(-1)[0]))


@dataclass
class PoolingRequestOutput:
    """What ``LLM.encode`` / ``AsyncLLM.encode`` return (``outputs``: a :class:`PoolingOutput`); ``embed``,
    ``classify`` and ``score`` return the subclasses below, whose ``outputs`` is the task's view of it."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True

    @classmethod
    def from_base(cls, request_output: "PoolingRequestOutput") -> "PoolingRequestOutput":
        view = _VIEWS.get(cls)
        outputs = request_output.outputs if view is None else view.from_base(request_output.outputs)
        return cls(request_output.request_id, outputs, request_output.prompt_token_ids,
                   request_output.num_cached_tokens, request_output.finished)


class EmbeddingRequestOutput(PoolingRequestOutput):
    """``outputs.embedding``: list[float]."""


class ClassificationRequestOutput(PoolingRequestOutput):
    """``outputs.probs``: list[float]."""


class ScoringRequestOutput(PoolingRequestOutput):
    """``outputs.score``: float."""


_VIEWS: dict[type, Any] = {EmbeddingRequestOutput: EmbeddingOutput, ClassificationRequestOutput: ClassificationOutput,
                           ScoringRequestOutput: ScoringOutput}
