"""Prompt + images -> expanded prompt and one :class:`MultiModalFeatureSpec` per image for the Qwen-VL family,
without torchvision.

transformers 5.x builds ``Qwen2VLProcessor`` only beside a video processor, which needs torchvision (it does not
import beside this CPU torch). The processor's image part needs neither: its image processor on the PIL backend
(``Qwen2VLImageProcessorPil``, HF's own slow path: smart resize to multiples of ``patch * merge``, rescale,
normalize, patchify) and its placeholder expansion (each ``<|image_pad|>`` becomes ``t * h * w / merge^2`` tokens,
``Qwen2VLProcessor.replace_image_token``), which this module does with the tokenizer. Each image's data is its own
rows of ``pixel_values`` and its ``image_grid_thw``; the 3-D M-RoPE positions of a prompt come from those grids
(:meth:`QwenVLProcessor.mrope_positions`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from pagedllm.errors import ParamError
from pagedllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from pagedllm.multimodal.mrope import mrope_positions
from pagedllm.multimodal.processing import ProcessedPrompt, hash_image
from pagedllm.multimodal.registry import supported_modalities


class QwenVLProcessor:
    """The tokenizer and the PIL image processor of a Qwen-VL checkpoint, with :class:`MultiModalProcessor`'s
    interface."""

    def __init__(self, model_path: str, hf_config: Any):
        from transformers import AutoImageProcessor, AutoTokenizer  # heavy: transformers

        self.modalities = supported_modalities(hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
        self.image_processor = AutoImageProcessor.from_pretrained(model_path, backend="pil", trust_remote_code=False)
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(hf_config.vision_config.spatial_merge_size)

    def process_images(self, images: Sequence[Any]) -> tuple[Any, Any]:
        out = self.image_processor(list(images), return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def __call__(self, prompt: Optional[str], prompt_token_ids: Optional[Sequence[int]],
                 images: Sequence[Any]) -> ProcessedPrompt:
        """Expand the prompt's ``<|image_pad|>`` placeholders (one per image, or runs already expanded) and process
        each image; the i-th placeholder is the i-th image."""
        if not images:
            raise ParamError("multi_modal_data.image", "no images given")
        field = "prompt" if prompt_token_ids is None else "prompt_token_ids"
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenizer(prompt)["input_ids"]
        pixels, grids = self.process_images(images)
        counts = [int(g.prod()) // self.merge ** 2 for g in grids]
        tok = self.image_token_id
        have = ids.count(tok)
        if have == len(images) and have != sum(counts):
            out: list[int] = []
            k = 0
            for t in ids:
                out.extend([tok] * counts[k] if t == tok else [t])
                k += t == tok
            ids = out
        elif have != sum(counts):
            raise ParamError(field, f"has {have} image placeholders ({tok}) for {len(images)} images: give one per "
                                    f"image, or {sum(counts)} (expanded)")
        features = []
        pos, row = 0, 0
        for i, (image, n, grid) in enumerate(zip(images, counts, grids)):
            start = ids.index(tok, pos)
            if ids[start:start + n] != [tok] * n:
                raise ParamError(field, f"image {i}: its placeholder run is not {n} tokens long")
            patches = int(grid.prod())
            features.append(MultiModalFeatureSpec(
                {"pixel_values": pixels[row:row + patches], "image_grid_thw": grids[i:i + 1]}, "image",
                hash_image(image), PlaceholderRange(start, n), {"size": image.size, "grid_thw": tuple(grid.tolist())}))
            pos, row = start + n, row + patches
        return ProcessedPrompt(ids, features)

    def mrope_positions(self, num_tokens: int, features: Sequence[MultiModalFeatureSpec]) -> tuple[np.ndarray, int]:
        """The prompt's 3-D positions and decode delta (``multimodal.mrope``)."""
        return mrope_positions(num_tokens, features, self.merge)
