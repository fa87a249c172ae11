"""The JSON-object arguments of the engine (``pooler_config``, ``speculative_config``, ``structured_outputs_config``,
``kv_transfer_config``, ``--hf-overrides`` ...): one parse, with the errors naming the field, or the unknown key under
it, the same way for each."""

from __future__ import annotations

import json
from typing import Any, Iterable, Optional

from pagedllm.errors import ParamError


def json_object(value: Any, field_name: str, known: Optional[Iterable[str]] = None) -> dict:
    """``value`` (a dict, or JSON text of an object) as a new dict; ParamError naming ``field_name`` when it is not
    one, or ``field_name.key`` for the first key outside ``known`` (when given)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ParamError(field_name, f"is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ParamError(field_name, f"must be a JSON object, got {type(value).__name__}")
    if known is not None:
        known = sorted(known)
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ParamError(f"{field_name}.{unknown[0]}", f"unknown key; known: {', '.join(known)}")
    return dict(value)
