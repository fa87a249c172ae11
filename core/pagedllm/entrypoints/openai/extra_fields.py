"""Request fields no request model declares: refused when pagedllm cannot honour them, logged otherwise.

OpenAI and vLLM fields that would change the output (another modality, legacy function calling, beam search in the
server, custom logits processors) are a 400 naming the field, never dropped silently. Fields that are safe to ignore
(bookkeeping such as ``store`` or ``metadata``) and names no API defines are accepted with a warning in the log, as
vLLM does (docs/structured_outputs.md lists both).
"""

from __future__ import annotations

import logging
from typing import Any

from pagedllm.entrypoints.openai.errors import APIError

logger = logging.getLogger("pagedllm.entrypoints")

REFUSED: dict[str, str] = {
    "functions": "legacy function calling is not supported; use tools",
    "function_call": "legacy function calling is not supported; use tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "use_beam_search": "beam search is offline only (LLM.beam_search)",
    "length_penalty": "beam search is offline only (LLM.beam_search)",
    "logits_processors": "custom logits processors are not supported",
    "guided_decoding_backend": "the backend is chosen at startup (--structured-outputs-backend)",
    "guided_whitespace_pattern": "not supported",
    "prompt_logprobs": "use echo with logprobs (completions) instead",
    "min_tokens_per_choice": "not supported",
}
IGNORED: frozenset[str] = frozenset({"store", "metadata", "service_tier", "verbosity",
                                     "safety_identifier", "prompt_cache_key", "request_id", "documents",
                                     "cache_salt", "add_special_tokens", "echo"})


def check_extra_fields(req: Any, endpoint: str) -> None:
    extra = getattr(req, "model_extra", None) or {}
    for name in extra:
        if name in REFUSED:
            raise APIError(400, f"{name}: {REFUSED[name]}", param=name, code="unsupported_parameter")
    ignored = sorted(extra)
    if ignored:
        logger.warning("%s: ignored request field(s) not supported by pagedllm: %s", endpoint, ", ".join(ignored))
