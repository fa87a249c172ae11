"""``PoolingParams``: what a pooling request (embed, classify, score, reward, encode) asks for, vLLM's names.

``None`` fields take the task's default when the engine accepts the request (:meth:`PoolingParams.verify`): embed
normalizes, classify/score apply the model's activation (softmax, or sigmoid for one label), as vLLM does."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from pagedllm.errors import ParamError

#: The pooling tasks (vLLM's ``PoolingTask`` values pagedllm runs).
POOLING_TASKS = ("embed", "classify", "score", "reward", "encode")


@dataclass
class PoolingParams:
    task: Optional[str] = None  # "embed" | "classify" | "score" | "reward" | "encode"; None: the model's default
    dimensions: Optional[int] = None  # embed: keep the first N dimensions (Matryoshka), renormalized
    normalize: Optional[bool] = None  # embed / encode: L2-normalize (default True for embed, False for encode)
    use_activation: Optional[bool] = None  # classify / score / reward: softmax or sigmoid (default True)
    truncate_prompt_tokens: Optional[int] = None  # keep only the last k prompt tokens (-1: max_model_len)

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ParamError("task", f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ParamError("dimensions", f"must be an integer >= 1, got {self.dimensions!r}")
        for name in ("normalize", "use_activation"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ParamError(name, f"must be a boolean, got {v!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or (t < 1 and t != -1)):
            raise ParamError("truncate_prompt_tokens", f"must be an integer >= 1 (or -1: max_model_len), got {t!r}")

    def clone(self, **changes) -> "PoolingParams":
        return replace(self, **changes)

    def verify(self, task: str) -> "PoolingParams":
        """A copy for ``task`` with every default filled; fields that mean nothing for it are refused by name."""
        if self.dimensions is not None and task != "embed":
            raise ParamError("dimensions", f"applies to embeddings only, not to task {task!r}")
        if self.normalize is not None and task not in ("embed", "encode"):
            raise ParamError("normalize", f"applies to embed and encode, not to task {task!r}")
        if self.use_activation is not None and task not in ("classify", "score", "reward"):
            raise ParamError("use_activation", f"applies to classify, score and reward, not to task {task!r}")
        normalize = self.normalize if self.normalize is not None else task == "embed"
        activation = self.use_activation if self.use_activation is not None else task in ("classify", "score",
                                                                                          "reward")
        return replace(self, task=task, normalize=normalize, use_activation=activation)
