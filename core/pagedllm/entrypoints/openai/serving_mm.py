"""The server's multimodal input side: content parts checked, images loaded, refusals as OpenAI 400s.

Every refusal that needs no image comes first (``parse_chat_messages``: unknown part types, audio/video, images for
a text-only model, ``--limit-mm-per-prompt``), so nothing is fetched for a request that would be refused anyway.
Images are then fetched (aiohttp, awaited) and decoded (threads) concurrently, never on the event loop; the first
failure cancels the rest. Each error is a 400 whose ``param`` is the part's field path.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, Optional, Sequence

from pagedllm.entrypoints.chat_inputs import model_modalities
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.multimodal.content_parts import ChatInputs, parse_chat_messages
from pagedllm.multimodal.media import MediaConnector, MediaError


def media_error(e: MediaError) -> APIError:
    return APIError(400, str(e), param=e.field, code=e.code)


def content_texts(messages: Sequence[Mapping[str, Any]]) -> list[Optional[str]]:
    """The text of parsed messages (string content, or the text entries of HF content lists), for size checks."""
    out: list[Optional[str]] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            out.extend(e.get("text") for e in content if isinstance(e, Mapping))
        else:
            out.append(content)
        out.append(m.get("reasoning"))
    return out


class MultiModalInputs:
    """Per server: which modalities the model takes (read once from its config), the limits and the media
    connector (``--allowed-media-domains``, ``--allowed-local-media-path``, fetch and size limits)."""

    def __init__(self, engine: Any, connector: Optional[MediaConnector] = None):
        config = engine.config
        self.model_path: str = engine.model_path
        self.hf_overrides = getattr(config, "hf_overrides", None)
        self.limit_mm_per_prompt: dict[str, int] = dict(getattr(config, "limit_mm_per_prompt", None) or {})
        self.connector = connector if connector is not None else MediaConnector(
            getattr(config, "allowed_local_media_path", None), getattr(config, "allowed_media_domains", None))
        self._modalities: Optional[frozenset[str]] = None

    async def modalities(self) -> frozenset[str]:
        if self._modalities is None:  # the config read runs on a thread, once
            self._modalities = await asyncio.to_thread(model_modalities, self.model_path, self.hf_overrides)
        return self._modalities

    async def parse(self, messages: Sequence[Mapping[str, Any]], field_name: str = "messages") -> ChatInputs:
        """Template messages and image items, or a 400 naming the part the model cannot take."""
        needs = any(isinstance(m.get("content"), list) for m in messages)
        modalities = await self.modalities() if needs else frozenset()
        try:
            return parse_chat_messages(messages, modalities, self.limit_mm_per_prompt, field_name)
        except MediaError as e:
            raise media_error(e) from None

    async def load(self, chat: ChatInputs) -> list[Any]:
        """The chat's images (RGB PIL images, in order), or a 400 naming the one that failed."""
        try:
            return await chat.load_images_async(self.connector)
        except MediaError as e:
            raise media_error(e) from None


def mm_inputs(serving: Any) -> MultiModalInputs:
    """The handler's :class:`MultiModalInputs` (``build_app`` sets one per server; made from the engine's config
    when a handler was built without it)."""
    mm = getattr(serving, "mm", None)
    if mm is None:
        mm = serving.mm = MultiModalInputs(serving.engine)
    return mm
