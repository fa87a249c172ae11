"""Prompt + images -> expanded prompt token ids + one :class:`MultiModalFeatureSpec` per image, with the model's own
HF processor (its image processor and its placeholder expansion), as vLLM's ``BaseMultiModalProcessor`` does.

The processor is loaded with transformers' PIL backend (``backend="pil"``): the default fast image processors need
torchvision, which does not import beside this CPU torch. The PIL path is HF's own slow implementation (resize,
crop, rescale, normalize in numpy), so the tensors are the ones HF's reference pipeline produces.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pagedllm.errors import ParamError
from pagedllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from pagedllm.multimodal.media import DEFAULT_MAX_IMAGE_PIXELS, decode_image
from pagedllm.multimodal.registry import processor_class, supported_modalities
from pagedllm.multimodal.shared_tensors import share_features


def hash_image(image: Any) -> str:
    """sha256 of an image's pixels (mode, size, palette and raw bytes): equal pixels share an encoder output and
    prefix-cache blocks, whatever file or URL they came from."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    if palette:  # palette images: the same indices under another palette are other pixels
        h.update(bytes(palette))
    h.update(image.tobytes())
    return h.hexdigest()


def as_image_list(mm_data: Any) -> list:
    """``multi_modal_data`` as vLLM takes it (``{"image": Image | [Image, ...]}``) -> the images, checked."""
    if mm_data is None:
        return []
    from PIL import Image  # heavy: PIL (text-only requests never import it)

    if not isinstance(mm_data, dict):
        raise ParamError("multi_modal_data", f"must be a dict such as {{'image': [images]}}, got "
                                             f"{type(mm_data).__name__}")
    for key in mm_data:
        if key != "image":
            raise ParamError(f"multi_modal_data.{key}", f"modality {key!r} is not supported (only 'image')")
    images = mm_data.get("image")
    if images is None:
        return []
    images = [images] if isinstance(images, Image.Image) else list(images)
    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            raise ParamError(f"multi_modal_data.image[{i}]", f"must be a PIL.Image.Image, got {type(im).__name__}")
    return images


@dataclass
class ProcessedPrompt:
    """A prompt after the model's processor: expanded token ids and one feature per image. The server's render
    workers send it to the engine as ``{"prompt_token_ids": ids, "mm_processed": ProcessedPrompt}`` with the
    features' tensors in shared memory (``shared_tensors``); the engine then runs no processor of its own."""

    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeatureSpec]


def load_processor(model_path: str, hf_config: Any) -> "MultiModalProcessor":
    """The processor the engine would use for the model of ``hf_config`` (the server loads one for its render
    workers)."""
    return processor_class(hf_config)(model_path, hf_config)


def process_encoded_images(processor: Any, tag: str, prompt_token_ids: Sequence[int],
                           items: Sequence[tuple[bytes, str]],
                           max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ProcessedPrompt:
    """The server's image work, in a render worker: decode each ``(encoded bytes, request field)`` item (MediaError
    naming the field), run the model's processor over the rendered chat's token ids, and move the tensors to shared
    memory (segments named for ``tag``). The content hashes are :func:`hash_image` of the decoded RGB pixels, as
    offline."""
    images = [decode_image(data, field_name, max_image_pixels) for data, field_name in items]
    processed = processor(None, list(prompt_token_ids), images)
    return ProcessedPrompt(processed.prompt_token_ids, share_features(processed.mm_features, tag))


class MultiModalProcessor:
    """The model's HF processor (``AutoProcessor``, PIL backend) and what the engine needs from it."""

    def __init__(self, model_path: str, hf_config: Any):
        from transformers import AutoProcessor  # heavy: transformers

        self.modalities = supported_modalities(hf_config)
        self.processor = AutoProcessor.from_pretrained(model_path, backend="pil", trust_remote_code=False)
        self.image_token_id: int = int(getattr(hf_config, "image_token_id", None)
                                       or getattr(hf_config, "image_token_index"))

    def num_image_tokens(self, image: Any) -> int:
        """Placeholder tokens one image expands to (the processor's own count)."""
        data = self.processor._get_num_multimodal_tokens(image_sizes=[(image.height, image.width)])
        return int(data.num_image_tokens[0])

    def __call__(self, prompt: Optional[str], prompt_token_ids: Optional[Sequence[int]],
                 images: Sequence[Any]) -> ProcessedPrompt:
        """Expand the prompt's image placeholders (one ``<image>`` per image in the text or the token ids, or the
        already expanded runs) and process each image; the i-th placeholder is the i-th image."""
        if not images:
            raise ParamError("multi_modal_data.image", "no images given")
        if prompt_token_ids is None:
            try:
                out = self.processor(text=prompt, images=list(images), return_tensors="pt")
            except ValueError as e:  # e.g. placeholders and images do not match: the processor says how
                raise ParamError("prompt", str(e)) from None
            ids = out["input_ids"][0].tolist()
            pixels = out["pixel_values"]
        else:
            ids = self._expand(list(prompt_token_ids), images)
            pixels = self.processor.image_processor(list(images), return_tensors="pt")["pixel_values"]
        features = []
        pos = 0
        for i, image in enumerate(images):
            n = self.num_image_tokens(image)
            try:
                start = ids.index(self.image_token_id, pos)
            except ValueError:
                start = -1
            if start < 0 or ids[start:start + n] != [self.image_token_id] * n:
                raise ParamError("prompt", f"image {i}: the prompt has no placeholder for it ({len(images)} images "
                                           f"need {len(images)} image tokens, one per image, in the prompt)")
            pos = start + n
            features.append(MultiModalFeatureSpec({"pixel_values": pixels[i:i + 1]}, "image", hash_image(image),
                                                  PlaceholderRange(start, n), {"size": image.size}))
        if self.image_token_id in ids[pos:]:
            raise ParamError("prompt", f"the prompt has more image placeholders than the {len(images)} images given")
        return ProcessedPrompt(ids, features)

    def _expand(self, ids: list[int], images: Sequence[Any]) -> list[int]:
        """Token-id prompts: one image token per image is expanded to the image's count; runs that already have the
        full count are kept."""
        tok = self.image_token_id
        counts = [self.num_image_tokens(im) for im in images]
        if ids.count(tok) == sum(counts):
            return ids
        if ids.count(tok) != len(images):
            raise ParamError("prompt_token_ids", f"has {ids.count(tok)} image tokens ({tok}) for {len(images)} "
                                                 f"images: give one per image, or {sum(counts)} (expanded)")
        out: list[int] = []
        k = 0
        for t in ids:
            if t == tok:
                out.extend([tok] * counts[k])
                k += 1
            else:
                out.append(t)
        return out


def prompt_parts(prompt: Any) -> tuple[Optional[str], Optional[list[int]]]:
    """(text, token ids) of a prompt given with images: a string, token ids, or vLLM's dict (``prompt`` and/or
    ``prompt_token_ids``; token ids win)."""
    if isinstance(prompt, dict):
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    elif isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, (list, tuple)):
        text, ids = None, list(prompt)
    else:
        raise ParamError("prompt", f"must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
    if ids is None and (not isinstance(text, str) or not text):
        raise ParamError("prompt", "must not be empty")
    if ids is not None and (not ids or any(not isinstance(t, int) for t in ids)):
        raise ParamError("prompt_token_ids", "must be a non-empty list of integers")
    return text, (list(ids) if ids is not None else None)
