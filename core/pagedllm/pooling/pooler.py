"""Poolers: a prompt's hidden states -> its pooled tensor, chunk by chunk (vLLM's ``Pooler`` heads).

A decoder prompt may run over several steps (chunked prefill), so pooling keeps per-request state fed one chunk at a
time: LAST keeps the last chunk's last row, CLS the first chunk's first row, MEAN a float32 running sum and count,
ALL every row. When the prompt's last chunk has run the head finishes the request: embed (Matryoshka truncation,
then L2 normalization, as vLLM), classify / score (the classifier, then softmax, or sigmoid for one label), reward
(the classifier on every row), encode (every row's hidden state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from pagedllm.pooling.spec import PoolingSpec
from pagedllm.pooling_params import PoolingParams


@dataclass
class PoolingState:
    """What one request has pooled so far."""

    pooling_type: str
    first: Optional[torch.Tensor] = None
    last: Optional[torch.Tensor] = None
    total: Optional[torch.Tensor] = None
    count: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)

    def reset(self) -> None:
        """Forget what was pooled: the request was preempted by recompute and its prompt runs again from 0."""
        self.first = self.last = self.total = None
        self.count = 0
        self.rows = []

    def add(self, hidden: torch.Tensor, start: int, num_prompt_tokens: int) -> None:
        """Rows ``hidden`` are prompt positions ``start..start + len(hidden)`` (copies are kept: the step's hidden
        buffer may be a captured graph's, rewritten next step)."""
        n = min(hidden.shape[0], num_prompt_tokens - start)
        if n <= 0:
            return
        hidden = hidden[:n]
        t = self.pooling_type
        if t == "CLS":
            if start == 0:
                self.first = hidden[0].float().clone()
        elif t == "LAST":
            if start + n >= num_prompt_tokens:
                self.last = hidden[n - 1].float().clone()
        elif t == "MEAN":
            s = hidden.float().sum(dim=0)
            self.total = s if self.total is None else self.total.add_(s)
            self.count += n
        else:  # ALL
            self.rows.append(hidden.float().clone())

    def pooled(self) -> torch.Tensor:
        t = self.pooling_type
        if t == "CLS":
            out = self.first
        elif t == "LAST":
            out = self.last
        elif t == "MEAN":
            out = self.total / self.count if self.total is not None else None
        else:
            out = torch.cat(self.rows) if self.rows else None
        if out is None:
            raise RuntimeError(f"{t} pooling finished before the prompt's rows it needs ran")
        return out


def activation(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's classify activation: sigmoid for one label, softmax over the labels otherwise."""
    return logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(dim=-1)


class Pooler:
    """The heads of one pooling model. ``classifier``: hidden ``[N, H]`` (model dtype) -> logits ``[N, labels]``
    (a ``*ForSequenceClassification`` ``score``), or None for embedding models."""

    def __init__(self, spec: PoolingSpec, classifier: Optional[Callable[[torch.Tensor], torch.Tensor]],
                 dtype: torch.dtype):
        self.spec = spec
        self.classifier = classifier
        self.dtype = dtype

    def pooling_type(self, task: str) -> str:
        if task in ("reward", "encode"):
            return "ALL"
        return self.spec.classify_pooling_type if task in ("classify", "score") else self.spec.pooling_type

    def new_state(self, params: PoolingParams) -> PoolingState:
        return PoolingState(self.pooling_type(params.task))

    @torch.inference_mode()
    def finish(self, state: PoolingState, params: PoolingParams) -> torch.Tensor:
        """The request's pooled tensor on the host, float32 (``params`` verified: every default filled)."""
        x = state.pooled()
        task = params.task
        if task == "embed":
            if params.dimensions is not None:
                x = x[..., :params.dimensions]
            if params.normalize:
                x = F.normalize(x, p=2, dim=-1)
        elif task in ("classify", "score", "reward"):
            if self.classifier is not None:  # (heads take rows [N, H]: a pooled vector is one row)
                rows = x.to(self.dtype)
                x = self.classifier(rows if rows.ndim == 2 else rows.unsqueeze(0)).float()
                x = x if state.pooling_type == "ALL" else x[0]
                if params.use_activation:
                    x = activation(x)
        elif params.normalize:  # encode
            x = F.normalize(x, p=2, dim=-1)
        with torch.inference_mode(False):  # a plain tensor for the caller (in-place ops allowed)
            return x.to("cpu", copy=True)


def classifier_of(model: Any) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The model's classification head (``score``), if it has one."""
    score = getattr(model, "score", None)
    return score if callable(score) else None
