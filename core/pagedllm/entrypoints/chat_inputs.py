"""What ``LLM.chat`` and the server share to turn a chat with images into an engine prompt.

The modalities a model takes are decided from its HF config alone (``multimodal.registry``); the server's HTTP
process holds no model, so it reads the config itself (with the engine's ``hf_overrides``) rather than asking the
engine process.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from pagedllm.multimodal.registry import supported_modalities

logger = logging.getLogger(__name__)


def model_modalities(model_path: str, hf_overrides: Optional[dict] = None) -> frozenset[str]:
    """The non-text modalities the model at ``model_path`` takes (empty: text only)."""
    from pagedllm.models.loader import load_config  # heavy: transformers

    try:
        hf_config = load_config(model_path)
    except Exception as e:  # noqa: BLE001 - the engine loaded this model; a config it cannot reread means text
        logger.warning("could not read %s's config to learn its input modalities (%s); treating it as text-only",
                       model_path, e)
        return frozenset()
    for key, value in (hf_overrides or {}).items():  # as LLMEngine applies them
        setattr(hf_config, key, value)
    return supported_modalities(hf_config)


def mm_prompt(prompt_token_ids: Sequence[int], images: Sequence[Any]) -> dict[str, Any]:
    """The engine prompt of a rendered chat: its token ids (the template's image placeholders among them, which
    the model's HF processor expands) and, when there are any, its images in order (vLLM's ``multi_modal_data``)."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
    if images:
        prompt["multi_modal_data"] = {"image": list(images)}
    return prompt
