"""vLLM's ``PoolerConfig`` (``--pooler-config`` JSON): how hidden states become one vector per prompt."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from pagedllm.errors import ParamError
from pagedllm.json_args import json_object

#: LAST: the prompt's last token (decoder embedders, ``*ForSequenceClassification``); MEAN: the average over the
#: prompt; CLS: the first token (BERT-style); ALL: every token (reward / token embeddings).
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")


@dataclass
class PoolerConfig:
    pooling_type: Optional[str] = None  # None: the checkpoint's (sentence-transformers config) or the task's
    normalize: Optional[bool] = None  # embed default (None: the checkpoint's Normalize module, else True)
    dimensions: Optional[int] = None  # embed default of PoolingParams.dimensions
    use_activation: Optional[bool] = None  # classify / score / reward default
    # Matryoshka sizes the model was trained for (None: any size up to hidden_size is accepted)
    matryoshka_dimensions: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ParamError("pooler_config.pooling_type", f"must be one of {', '.join(POOLING_TYPES)}, got "
                                                               f"{self.pooling_type!r}")
            self.pooling_type = self.pooling_type.upper()
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ParamError("pooler_config.dimensions", f"must be an integer >= 1, got {self.dimensions!r}")
        for name in ("normalize", "use_activation"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ParamError(f"pooler_config.{name}", f"must be a boolean, got {v!r}")

    @classmethod
    def parse(cls, value: Any) -> Optional["PoolerConfig"]:
        """A PoolerConfig from itself, a dict or a JSON object string (the CLI flag); None stays None."""
        if value is None or isinstance(value, cls):
            return value
        value = json_object(value, "pooler_config")
        if "activation" in value and "use_activation" not in value:  # vLLM's older name
            value["use_activation"] = value.pop("activation")
        return cls(**json_object(value, "pooler_config", (f.name for f in fields(cls))))

    def to_dict(self) -> dict:
        return asdict(self)
