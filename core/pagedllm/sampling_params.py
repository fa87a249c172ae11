"""Per-request sampling settings, with vLLM's names and defaults; bad values raise naming the field."""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

from pagedllm.deprecated import moved
from pagedllm.errors import ParamError as _ParamError

#: What ``torch.Generator.manual_seed`` takes (a 64-bit pattern, signed or not); beyond it is an overflow (a 500).
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1


def _real(v: Any) -> bool:
    """A finite int or float (not a bool): NaN and infinities would pass every range check below or poison logits."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, one of ``choice``, an EBNF/Lark ``grammar`` or any JSON
    object (vLLM's names). Exactly one may be set; the engine compiles it before the request is scheduled."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise _ParamError("structured_outputs", "exactly one of json, regex, choice, grammar or json_object must be "
                                                   f"set, got {set_ or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise _ParamError("structured_outputs.json", f"not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise _ParamError("structured_outputs.json", "must be a JSON schema (an object)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise _ParamError("structured_outputs.regex", "must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise _ParamError("structured_outputs.grammar", "must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise _ParamError("structured_outputs.choice", "must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """Cache key: the kind and a canonical text of the spec."""
        v: Any = getattr(self, self.kind)
        return self.kind, v if isinstance(v, str) else _json.dumps(v, sort_keys=True)


@dataclass
class SamplingParams:
    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None  # number of top logprobs per generated token (the sampled one is added)
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    priority: int = 0  # used by the `priority` scheduling policy: lower value runs first (vLLM's convention)
    # "cumulative": every step, everything so far; "delta": every step, only what is new (the prompt fields only in
    # the first); "final_only": once, when finished (vLLM's RequestOutputKind)
    output_kind: str = "cumulative"
    structured_outputs: Optional[StructuredOutputsParams] = None
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit, in [-100, 100] (OpenAI)
    allowed_token_ids: Optional[list[int]] = None  # only these tokens may be sampled
    bad_words: Optional[list[str]] = None  # word sequences that may never be generated (vLLM)
    truncate_prompt_tokens: Optional[int] = None  # keep only the last k prompt tokens
    extra_args: Optional[dict] = None  # vLLM's: e.g. {"kv_transfer_params": {...}} for a KV connector

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.best_of is None:
            self.best_of = self.n
        self._verify()

    def _verify(self) -> None:
        def bad(name: str, msg: str) -> None:
            raise _ParamError(name, msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            bad("best_of", f"must be an integer >= n ({self.n}), got {self.best_of!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _real(v) or not -2.0 <= v <= 2.0:
                bad(name, f"must be in [-2, 2], got {v!r}")
        if not _real(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")
        if not _real(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not _real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not _SEED_MIN <= self.seed <= _SEED_MAX):
            bad("seed", f"must be a 64-bit integer (in [-2**63, 2**64 - 1]), got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0 or v > 20):
                bad(name, f"must be an integer in [0, 20], got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if self.output_kind not in ("cumulative", "delta", "final_only"):
            bad("output_kind", f"must be 'cumulative', 'delta' or 'final_only', got {self.output_kind!r}")
        if not isinstance(self.priority, int):
            bad("priority", f"must be an integer, got {self.priority!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must map token ids to biases")
            for k, v in self.logit_bias.items():
                if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                    bad("logit_bias", f"keys must be token ids (non-negative integers), got {k!r}")
                if not _real(v) or not -100 <= v <= 100:
                    bad("logit_bias", f"values must be numbers in [-100, 100], got {v!r} for token {k}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of token ids (non-negative integers)")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            bad("bad_words", "must be a list of non-empty strings")
        if self.truncate_prompt_tokens is not None and (not isinstance(self.truncate_prompt_tokens, int)
                                                        or self.truncate_prompt_tokens < 1):
            bad("truncate_prompt_tokens", f"must be an integer >= 1, got {self.truncate_prompt_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


@dataclass
class BeamSearchParams:
    """``LLM.beam_search`` settings, as in vLLM."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: Optional[StructuredOutputsParams] = None  # every beam follows the grammar

    def __post_init__(self) -> None:
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise _ParamError("structured_outputs", "must be a StructuredOutputsParams")
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise _ParamError("beam_width", f"must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise _ParamError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")


def __getattr__(name: str):
    if name == "ParamError":  # contract v2's path; removed with v3
        globals()["ParamError"] = moved("pagedllm.sampling_params.ParamError", "pagedllm.errors.ParamError",
                                        _ParamError)  # one warning, not one per lookup
        return _ParamError
    raise AttributeError(f"module 'pagedllm.sampling_params' has no attribute {name!r}")
