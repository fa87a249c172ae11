"""``speculative_config`` with vLLM's keys, validated so a bad value names its key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from pagedllm.errors import ParamError
from pagedllm.json_args import json_object

METHODS = ("ngram", "draft_model", "eagle")
MODEL_METHODS = ("draft_model", "eagle")  # methods that load a checkpoint from ``model``
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "disable_by_batch_size", "acceptance_threshold"}


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    model: Optional[str] = None  # draft model (HF folder or .gguf) or EAGLE head folder
    # No speculation while this many requests or more run (vLLM v0). Unset: the measured batch throttle decides
    # (spec_decode/throttle.py); 0 turns both off (always speculate where acceptance allows).
    disable_by_batch_size: Optional[int] = None
    acceptance_threshold: float = 0.3  # per-request acceptance rate (EMA) below which a request backs off

    @classmethod
    def parse(cls, value: Union[None, str, dict, "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """From a dict or a JSON string (``--speculative-config``); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        d = json_object(value, "speculative_config", _KEYS)
        method = d.get("method")
        if method is None:
            if d.get("model") is None:
                raise ParamError("speculative_config.method", "is required (ngram or draft_model), or give model")
            method = "draft_model"
        if method in ("eagle3", "medusa", "mtp"):
            raise ParamError("speculative_config.method", f"{method!r} is not implemented; use one of {METHODS}")
        if method not in METHODS:
            raise ParamError("speculative_config.method", f"must be one of {METHODS}, got {method!r}")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ParamError("speculative_config.num_speculative_tokens", f"must be an integer >= 1, got {k!r}")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if method == "ngram":
            if lo is None and hi is None:
                lo = hi = 5  # vLLM's default
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ParamError(f"speculative_config.{name}", f"must be an integer >= 1, got {v!r}")
            if lo > hi:
                raise ParamError("speculative_config.prompt_lookup_min",
                                 f"{lo} exceeds prompt_lookup_max {hi}")
            if d.get("model") is not None:
                raise ParamError("speculative_config.model", "is only used by methods draft_model and eagle, "
                                                             "not ngram")
        else:
            if not isinstance(d.get("model"), str) or not d["model"]:
                raise ParamError("speculative_config.model", f"method {method} needs a model path")
            if lo is not None or hi is not None:
                raise ParamError("speculative_config.prompt_lookup_min", "is only used by method ngram")
        dbs = d.get("disable_by_batch_size")
        if dbs is not None and (not isinstance(dbs, int) or isinstance(dbs, bool) or dbs < 0):
            raise ParamError("speculative_config.disable_by_batch_size", f"must be an integer >= 0, got {dbs!r}")
        thr = d.get("acceptance_threshold", 0.3)
        if not isinstance(thr, (int, float)) or not 0.0 <= thr <= 1.0:
            raise ParamError("speculative_config.acceptance_threshold", f"must be in [0, 1], got {thr!r}")
        return cls(method, k, lo, hi, d.get("model"), dbs, float(thr))
