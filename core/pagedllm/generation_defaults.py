"""Default sampling parameters from the model's ``generation_config.json``, as vLLM's ``--generation-config``.

``auto`` (the default) reads the model folder's file, ``vllm`` ignores it (SamplingParams' own defaults), a folder
path reads that folder's file. Only values that differ from transformers' ``GenerationConfig`` defaults count
(vLLM's ``ModelConfig.get_diff_sampling_param``), and only the sampling fields below; they apply where a request
leaves the field unset: ``LLM.generate`` without SamplingParams, or an OpenAI request that omits the field.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

from pagedllm.errors import ParamError
from pagedllm.sampling_params import SamplingParams
from pagedllm.startup_log import stage

logger = logging.getLogger(__name__)

#: ``generation_config.json`` keys that become default sampling parameters (vLLM's list); ``max_new_tokens`` is
#: SamplingParams' ``max_tokens``.
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
GENERATION_CONFIG_MODES = ("auto", "vllm")


def check_generation_config(value: str) -> None:
    """``auto``, ``vllm`` or a folder holding ``generation_config.json``; else a ParamError naming the field."""
    if value in GENERATION_CONFIG_MODES:
        return
    if not isinstance(value, str) or not os.path.isfile(os.path.join(os.path.expanduser(value),
                                                                      "generation_config.json")):
        raise ParamError("generation_config", f"must be 'auto' (the model's generation_config.json), 'vllm' (ignore "
                                              f"it) or a folder holding a generation_config.json; got {value!r}")


@functools.lru_cache(maxsize=None)
def get_diff_sampling_param(model_path: str, generation_config: str = "auto") -> dict[str, Any]:
    """The model's default sampling parameters (SamplingParams field -> value), printed once per process when there
    are any. Empty for ``vllm``, for a GGUF file and for a folder without ``generation_config.json``."""
    if generation_config == "vllm":
        return {}
    folder = model_path if generation_config == "auto" else os.path.expanduser(generation_config)
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    from transformers import GenerationConfig  # heavy: transformers

    try:
        diff = GenerationConfig.from_pretrained(folder).to_diff_dict()
    except (OSError, ValueError) as e:  # an unreadable file leaves vLLM's defaults, said once
        logger.warning("%s is unreadable (%s); using pagedllm's sampling defaults", path, e)
        return {}
    params = {key: diff[key] for key in SAMPLING_KEYS if diff.get(key) is not None}
    if "max_new_tokens" in params:
        params["max_tokens"] = params.pop("max_new_tokens")
    try:  # a value no request could use fails here, at start-up, not in every request
        SamplingParams(**params)
    except ParamError as e:
        raise ParamError("generation_config", f"{path} sets {e.field}: {e.message}; fix the file, or pass "
                                              "--generation-config vllm to ignore it") from None
    if params:
        stage("generation defaults from %s: %s (for requests that leave them unset; --generation-config vllm "
              "ignores them)", path, ", ".join(f"{k}={v}" for k, v in params.items()))
    return params


def default_sampling_params(defaults: dict[str, Any]) -> SamplingParams:
    """What ``LLM.generate`` uses without SamplingParams (vLLM's ``LLM.get_default_sampling_params``)."""
    return SamplingParams(**defaults)


def apply_defaults(params: SamplingParams, defaults: dict[str, Any],
                   is_unset: Callable[[str], bool]) -> SamplingParams:
    """``params`` with ``defaults`` filled in for the fields ``is_unset(field)`` says the request left unset."""
    changes = {k: v for k, v in defaults.items() if is_unset(k)}
    return params.clone(**changes) if changes else params


def request_unset(request: Any) -> Callable[[str], bool]:
    """For an OpenAI request (pydantic): was ``field`` left out (or null)? ``max_tokens`` counts as set when the
    request sent ``max_tokens`` or chat's ``max_completion_tokens``."""
    sent = getattr(request, "model_fields_set", set())

    def unset(field: str) -> bool:
        if field == "max_tokens":
            return not any(f in sent and getattr(request, f, None) is not None
                           for f in ("max_tokens", "max_completion_tokens"))
        return getattr(request, field, None) is None

    return unset


def cli_sampling_params(defaults: dict[str, Any], fallback: dict[str, Any], **explicit: Any) -> SamplingParams:
    """A CLI command's SamplingParams: its flags (``explicit``, None = not given) over the model's ``defaults`` over
    the command's own ``fallback`` (greedy for ``generate``, 0.7 for ``chat``)."""
    given = {k: v for k, v in explicit.items() if v is not None}
    return SamplingParams(**{**fallback, **defaults, **given})

