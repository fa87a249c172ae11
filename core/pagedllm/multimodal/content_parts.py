"""OpenAI chat content parts -> HF chat-template messages plus the ordered images (vLLM's ``parse_chat_messages``).

One function for ``LLM.chat`` and the server's chat, responses, tokenize and pooling paths, so each refuses the same
input the same way. It only reads the request (no I/O): every refusal that needs no image — a part type pagedllm does
not know, a modality it does not serve (audio, video, files), an image sent to a model that takes text only, more
images than ``--limit-mm-per-prompt`` — happens before anything is fetched or decoded. The images are loaded
afterwards, in request order, by a :class:`~pagedllm.multimodal.media.MediaConnector`.

A text-only model keeps getting plain string content (the text parts joined), so its template and output are what
they were. A model that takes images gets HF's convention: a content list of ``{"type": "text", "text": ...}`` and
``{"type": "image"}`` entries, from which a VLM's template renders its image placeholder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from pagedllm.multimodal.media import MediaConnector, MediaError

#: vLLM's default per modality when ``limit_mm_per_prompt`` leaves it out.
DEFAULT_LIMIT_PER_PROMPT = 999
MODALITIES = ("image", "audio", "video")
_TEXT_PARTS = ("text", "input_text", "output_text")
_IMAGE_PARTS = ("image_url", "input_image", "image_pil")
#: Parts of modalities pagedllm does not take (OpenAI's and vLLM's names) -> what they are.
_UNSUPPORTED_PARTS = {"input_audio": "audio", "audio_url": "audio", "video_url": "video", "input_video": "video",
                      "file": "file", "input_file": "file", "image_embeds": "image embeddings"}


@dataclass(frozen=True)
class ImageItem:
    """One image of a conversation: its URL (or, offline, a ``PIL.Image`` already loaded) and its field path."""

    field: str
    url: Optional[str] = None
    image: Any = None
    detail: Optional[str] = None


@dataclass
class ChatInputs:
    """The template messages and, in order of appearance, the images they refer to."""

    messages: list[dict[str, Any]]
    images: list[ImageItem] = field(default_factory=list)

    def load_images(self, connector: MediaConnector) -> list[Any]:
        """The images as RGB ``PIL.Image`` objects (blocking: the offline API)."""
        return [it.image if it.image is not None else connector.load_image(it.url, it.field) for it in self.images]

    async def load_images_async(self, connector: MediaConnector) -> list[Any]:
        """The images, fetched and decoded concurrently off the event loop (the server)."""
        todo = [(it.url, it.field) for it in self.images if it.image is None]
        loaded = iter(await connector.load_images_async(todo))
        return [it.image if it.image is not None else next(loaded) for it in self.images]


def parse_limit_mm_per_prompt(value: Union[None, str, Mapping[str, Any]]) -> dict[str, int]:
    """``--limit-mm-per-prompt`` / ``LLM(limit_mm_per_prompt=...)``: vLLM's ``{"image": N}`` (a dict or its JSON)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise MediaError("limit_mm_per_prompt", f'must be a JSON object such as {{"image": 4}}: {e}',
                             code="invalid_parameter") from None
    if not isinstance(value, Mapping):
        raise MediaError("limit_mm_per_prompt", f'must be an object such as {{"image": 4}}, got '
                                                f"{type(value).__name__}", code="invalid_parameter")
    out = {}
    for k, v in value.items():
        if k not in MODALITIES:
            raise MediaError("limit_mm_per_prompt", f"unknown modality {k!r} (one of {', '.join(MODALITIES)})",
                             code="invalid_parameter")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise MediaError("limit_mm_per_prompt", f"{k}: must be an integer >= 0, got {v!r}",
                             code="invalid_parameter")
        out[k] = v
    return out


def parse_chat_messages(messages: Sequence[Mapping[str, Any]], modalities: frozenset[str] = frozenset(),
                        limit_mm_per_prompt: Optional[Mapping[str, int]] = None,
                        field_name: str = "messages") -> ChatInputs:
    """Template messages and image items of OpenAI ``messages`` (dicts; content a string, None or a part list).

    ``modalities``: what the model takes besides text (``multimodal.registry.supported_modalities``);
    ``field_name``: the request field the messages came from, for error paths (``messages[1].content[0]``); a part
    may carry its own path under ``_field`` (the Responses API's input items are not one message each).
    Raises :class:`MediaError` naming the part for anything it cannot take."""
    limits = dict(limit_mm_per_prompt or {})
    out: list[dict[str, Any]] = []
    images: list[ImageItem] = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, (list, tuple)):
            out.append(dict(msg))
            continue
        entries: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            where = f"{field_name}[{i}].content[{j}]"
            if isinstance(part, Mapping) and isinstance(part.get("_field"), str):
                where = part["_field"]  # a part that knows its own request path (the Responses API's items)
            kind = _part_type(part, where)
            if kind in _TEXT_PARTS or kind == "refusal":
                text = part.get("refusal" if kind == "refusal" else "text")
                text = "" if text is None else text
                if not isinstance(text, str):
                    raise MediaError(f"{where}.{'refusal' if kind == 'refusal' else 'text'}", "must be a string",
                                     code="invalid_content_part")
                entries.append({"type": "text", "text": text})
            elif kind in _IMAGE_PARTS:
                if "image" not in modalities:
                    raise MediaError(where, "this model takes text only; it cannot take image parts",
                                     code="unsupported_modality")
                limit = limits.get("image", DEFAULT_LIMIT_PER_PROMPT)
                if len(images) >= limit:
                    raise MediaError(where, f"at most {limit} image(s) may be given in one prompt "
                                            "(--limit-mm-per-prompt)", code="too_many_images")
                images.append(_image_item(part, kind, where))
                entries.append({"type": "image"})
            elif kind in _UNSUPPORTED_PARTS:
                raise MediaError(f"{where}.type", f"{kind!r}: {_UNSUPPORTED_PARTS[kind]} input is not supported by "
                                                  "this server (text and image parts are)", code="unsupported_modality")
            else:
                raise MediaError(f"{where}.type", f"unknown content part type {kind!r} (text, image_url and "
                                                  "input_image are supported)", code="invalid_content_part")
        if "image" in modalities:
            new_content: Any = entries  # HF's convention for VLM templates
        else:
            new_content = "".join(e["text"] for e in entries)  # text-only templates take strings
        out.append({**msg, "content": new_content})
    return ChatInputs(out, images)


def _part_type(part: Any, where: str) -> str:
    if not isinstance(part, Mapping):
        raise MediaError(where, f"a content part must be an object, got {type(part).__name__}",
                         code="invalid_content_part")
    kind = part.get("type")
    if not isinstance(kind, str):
        raise MediaError(f"{where}.type", "must be a string", code="invalid_content_part")
    return kind


def _image_item(part: Mapping[str, Any], kind: str, where: str) -> ImageItem:
    if kind == "image_pil":  # vLLM's offline part: a PIL image as is
        image = part.get("image_pil")
        if image is None or not hasattr(image, "convert"):
            raise MediaError(f"{where}.image_pil", "must be a PIL.Image", code="invalid_content_part")
        from pagedllm.multimodal.media import to_rgb

        return ImageItem(f"{where}.image_pil", image=to_rgb(image))
    value = part.get("image_url")
    if kind == "image_url":  # chat: {"url": ..., "detail": ...}
        if not isinstance(value, Mapping) or not isinstance(value.get("url"), str):
            raise MediaError(f"{where}.image_url", 'must be an object with a "url" string',
                             code="invalid_content_part")
        return ImageItem(f"{where}.image_url.url", url=value["url"], detail=value.get("detail"))
    if not isinstance(value, str):  # Responses' input_image: {"image_url": "...", "detail": ...}
        field_name = f"{where}.file_id" if part.get("file_id") is not None else f"{where}.image_url"
        why = ("file ids are not supported; send image_url" if field_name.endswith("file_id")
               else "must be a URL string")
        raise MediaError(field_name, why, code="invalid_content_part")
    return ImageItem(f"{where}.image_url", url=value, detail=part.get("detail"))
