"""Idefics3 / SmolVLM prompts: each image is one item whose placeholder range is its whole expansion (tiles,
global view and their ``<fake_token_around_image>`` / ``<row_r_col_c>`` / ``<global-img>`` markers), not a run of
``<image>`` tokens, so the generic processor's contiguous-run search does not apply.

Everything comes from the model's HF processor on the PIL backend (``Idefics3ImageProcessorPil`` /
``SmolVLMImageProcessorPil``, HF's own numpy implementation, no torchvision): the expanded prompt, each image's
tiles (``pixel_values [1, tiles, 3, S, S]``, ``pixel_attention_mask``) and its rows and columns, whose prompt
string is the processor's own ``replace_image_token``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from pagedllm.errors import ParamError
from pagedllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from pagedllm.multimodal.processing import MultiModalProcessor, ProcessedPrompt, hash_image


def find_span(ids: list[int], span: list[int], start: int) -> int:
    """First index ``>= start`` where ``span`` occurs in ``ids`` (-1: none)."""
    n = len(span)
    first = span[0]
    for i in range(start, len(ids) - n + 1):
        if ids[i] == first and ids[i:i + n] == span:
            return i
    return -1


class Idefics3MultiModalProcessor(MultiModalProcessor):
    def process_image(self, image: Any) -> tuple[dict[str, torch.Tensor], list[int]]:
        """One image's processor tensors and the token ids of its expansion in the prompt."""
        out = self.processor.image_processor([image], return_tensors="pt", return_row_col_info=True)
        data = {"pixel_values": out["pixel_values"]}
        if "pixel_attention_mask" in out:
            data["pixel_attention_mask"] = out["pixel_attention_mask"]
        text = self.processor.replace_image_token({"rows": out["rows"], "cols": out["cols"]}, 0)
        span = self.processor.tokenizer.encode(text, add_special_tokens=False)
        return data, span

    def num_image_tokens(self, image: Any) -> int:
        return len(self.process_image(image)[1])

    def __call__(self, prompt: Optional[str], prompt_token_ids: Optional[Sequence[int]],
                 images: Sequence[Any]) -> ProcessedPrompt:
        """Expand the prompt's ``<image>`` placeholders (in the text, or one image token per image in the token ids,
        or already expanded) and process each image; the i-th placeholder is the i-th image."""
        if not images:
            raise ParamError("multi_modal_data.image", "no images given")
        processed = [self.process_image(im) for im in images]
        tok = self.image_token_id
        if prompt_token_ids is None:
            try:
                ids = self.processor(text=prompt, images=list(images))["input_ids"][0]
            except ValueError as e:  # placeholders and images do not match: the processor says how
                raise ParamError("prompt", str(e)) from None
            ids = list(ids)
        else:
            ids = list(prompt_token_ids)
            if ids.count(tok) == len(images):  # one <image> per image: the processor's expansion in its place
                out: list[int] = []
                k = 0
                for t in ids:
                    if t == tok:
                        out.extend(processed[k][1])
                        k += 1
                    else:
                        out.append(t)
                ids = out
        features = []
        pos = 0
        for i, (image, (data, span)) in enumerate(zip(images, processed)):
            start = find_span(ids, span, pos)
            if start < 0:
                raise ParamError("prompt_token_ids" if prompt_token_ids is not None else "prompt",
                                 f"image {i}: the prompt has no placeholder for it (give one <image> per image)")
            pos = start + len(span)
            data = {**data, "span_ids": torch.tensor(span, dtype=torch.long)}
            features.append(MultiModalFeatureSpec(data, "image", hash_image(image), PlaceholderRange(start, len(span)),
                                                  {"size": image.size}))
        if ids.count(tok) != sum(span.count(tok) for _, span in processed):
            raise ParamError("prompt" if prompt_token_ids is None else "prompt_token_ids",
                             f"the prompt has more image placeholders than the {len(images)} images given")
        return ProcessedPrompt(ids, features)
