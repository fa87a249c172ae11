"""The server's multimodal input side: content parts checked, images loaded, refusals as OpenAI 400s.

Every refusal that needs no image comes first (``parse_chat_messages``: unknown part types, audio/video, images for
a text-only model, ``--limit-mm-per-prompt``), so nothing is fetched for a request that would be refused anyway.
Images are then fetched (aiohttp, awaited) concurrently, never on the event loop; the first failure cancels the rest.
Decoding and the model's processor run in a render worker (``render_pool.py``): the engine receives the expanded
token ids and the processor's tensors in shared memory (``multimodal/shared_tensors.py``), so its loop never
decodes or resizes an image. Each error is a 400 whose ``param`` is the part's field path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any, Mapping, Optional, Sequence

from pagedllm.entrypoints.chat_inputs import mm_prompt, model_modalities
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.render_pool import RenderTimeout
from pagedllm.entrypoints.openai.render_worker import RenderError
from pagedllm.entrypoints.openai.serving_common import timeout_error
from pagedllm.errors import ParamError
from pagedllm.multimodal.content_parts import ChatInputs, parse_chat_messages
from pagedllm.multimodal.media import MediaConnector, MediaError, decode_image
from pagedllm.multimodal.processing import ProcessedPrompt, load_processor
from pagedllm.multimodal.registry import MULTIMODAL_ARCHITECTURES, supported_modalities
from pagedllm.multimodal.shared_tensors import new_tag, release_features

logger = logging.getLogger(__name__)

EncodedImage = tuple[bytes, str]  # an image's encoded bytes and its request field
IMAGE_PROCESSING_TIMEOUT = 60.0  # seconds a render worker may spend on one request's images


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

    async def load(self, chat: ChatInputs) -> list[EncodedImage]:
        """The chat's images, encoded (``(bytes, field)``, in order), or a 400 naming the one that failed to
        load; :meth:`prompt` decodes them."""
        items = [(it.url, it.field) for it in chat.images]
        try:
            return list(zip(await self.connector.load_images_async(items, decode=False), [f for _, f in items]))
        except MediaError as e:
            raise media_error(e) from None

    async def prompt(self, serving: Any, prompt_token_ids: list[int], images: Sequence[EncodedImage], start: float,
                     param: str = "messages") -> dict[str, Any]:
        """The engine prompt of a rendered chat. With images, a render worker decodes them and runs the model's
        processor: ``{"prompt_token_ids": expanded ids, "mm_processed": ProcessedPrompt}`` with the tensors in
        shared memory; the caller hands it to the engine or passes it to :func:`release_prompt`. Errors are 400s naming
        the image's field (or ``param`` for a prompt the processor refuses)."""
        if not images:
            return mm_prompt(prompt_token_ids, [])
        renderer = serving.renderer
        if renderer is None or not getattr(renderer, "takes_images", False):  # (an app built without the pool's
            # processor: decode here on threads; the engine runs the processor)
            try:
                pils = await asyncio.gather(*(asyncio.to_thread(decode_image, data, field_name,
                                                                 self.connector.max_image_pixels)
                                              for data, field_name in images))
            except MediaError as e:
                raise media_error(e) from None
            return mm_prompt(prompt_token_ids, pils)
        job = ("mm", new_tag(), list(prompt_token_ids), list(images), self.connector.max_image_pixels)
        task = asyncio.ensure_future(self._run(serving, job, param, start))
        try:
            processed: ProcessedPrompt = await asyncio.shield(task)
        except asyncio.CancelledError:  # the client left: whatever the worker still sends back is dropped
            task.add_done_callback(_release_result)
            raise
        except MediaError as e:
            raise media_error(e) from None
        except ParamError as e:
            raise APIError(400, f"{param}: {e.message}", param=param) from None
        return {"prompt_token_ids": processed.prompt_token_ids, "mm_processed": processed}


    async def _run(self, serving: Any, job: tuple, param: str, start: float) -> ProcessedPrompt:
        """The "mm" job within ``IMAGE_PROCESSING_TIMEOUT`` (an image may take longer than a template's
        ``--template-render-timeout``) and the request's deadline."""
        left = serving.remaining(start)
        budget = IMAGE_PROCESSING_TIMEOUT if left is None else min(IMAGE_PROCESSING_TIMEOUT, left)
        try:
            return await serving.renderer.run(job, budget)
        except RenderTimeout:
            if left is not None and left <= IMAGE_PROCESSING_TIMEOUT:
                raise timeout_error(serving.limits.request_timeout) from None
            raise APIError(400, f"{param}: processing this request's images took longer than "
                                f"{IMAGE_PROCESSING_TIMEOUT:g} s", param=param,
                           code="image_processing_timeout") from None
        except RenderError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None


def looks_multimodal(model: Optional[str]) -> bool:
    """Whether ``model``'s config.json (a local folder, or the HF cache's copy: no network, no transformers import)
    names an architecture that takes images; False when it cannot tell. Only decides what the render workers'
    forkserver preloads."""
    path = None
    if model and os.path.isdir(model):
        path = os.path.join(model, "config.json")
    elif model and model.count("/") == 1:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "config.json")
            path = found if isinstance(found, str) else None
        except Exception:  # noqa: BLE001 - no hub client or a malformed id: the engine will say
            path = None
    try:
        with open(path or "", encoding="utf-8") as f:
            archs = json.load(f).get("architectures") or ()
    except (OSError, ValueError, AttributeError):
        return False
    return any(a in MULTIMODAL_ARCHITECTURES for a in archs)


def render_processor(config: Any) -> Any:
    """The model's processor for the render workers, or None for a text-only model (read from its config with the
    engine's ``hf_overrides``, as the engine does). The server calls it on a thread while the engine loads; if it
    fails, images are decoded on threads here and processed by the engine, as before (logged)."""
    from pagedllm.models import load_config, resolve_model_path  # heavy: transformers

    try:
        path = resolve_model_path(config.model)
        if str(path).endswith(".gguf"):  # text models only; reading its metadata on this thread also raced the main
            return None  # thread's import of transformers' lazy GGUF modules (an ImportError at start-up, seen once)
        hf_config = load_config(path)
        for key, value in (getattr(config, "hf_overrides", None) or {}).items():
            setattr(hf_config, key, value)
        if not supported_modalities(hf_config):
            return None
        return load_processor(path, hf_config)
    except Exception as e:  # noqa: BLE001 - the engine's own load reports a bad model; this is an optimisation
        logger.warning("could not load the model's processor for the render workers (%s); the engine process will "
                       "process images", e)
        return None


def release_prompt(prompt: Mapping[str, Any]) -> None:
    """Unlink the shared tensors of a prompt that will not reach the engine (refused or cancelled after
    :meth:`MultiModalInputs.prompt`); idempotent, and harmless after the engine took them."""
    processed = prompt.get("mm_processed")
    if processed is not None:
        release_features(processed.mm_features)


def _release_result(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        release_features(task.result().mm_features)


def mm_inputs(serving: Any) -> MultiModalInputs:
    """The handler's :class:`MultiModalInputs` (``build_app`` sets one per server; made from the engine's config
    when a handler was built without it)."""
    mm = getattr(serving, "mm", None)
    if mm is None:
        mm = serving.mm = MultiModalInputs(serving.engine)
    return mm
