"""Gemma 3 prompts: the placeholder a prompt carries is ``<start_of_image>`` (the tokenizer's ``boi_token``), which
HF's ``Gemma3Processor`` expands to ``\\n\\n<start_of_image>`` + ``image_seq_length`` soft tokens +
``<end_of_image>\\n\\n``; the image's item is its run of soft tokens (``config.image_token_id``, HF's
``token_type_ids == 1``).

Text prompts go through the processor itself (the generic path: it finds each run of soft tokens). Token-id prompts
carry one ``<start_of_image>`` per image (what a chat template renders), so the generic expansion of one soft token
per image does not apply: each ``<start_of_image>`` becomes the token ids of the processor's own
``full_image_sequence``. Images are processed by ``Gemma3ImageProcessorPil`` (HF's numpy path, no torchvision),
pan-and-scan off as in HF's defaults: every image is one ``[1, 3, S, S]`` view.
"""

from __future__ import annotations

from typing import Any, Sequence

from pagedllm.errors import ParamError
from pagedllm.multimodal.processing import MultiModalProcessor


class Gemma3MultiModalProcessor(MultiModalProcessor):
    def _expand(self, ids: list[int], images: Sequence[Any]) -> list[int]:
        tok = self.processor.tokenizer
        boi = tok.convert_tokens_to_ids(self.processor.boi_token)
        counts = [self.num_image_tokens(im) for im in images]
        if ids.count(self.image_token_id) == sum(counts):  # already expanded
            return ids
        if ids.count(boi) != len(images) or self.image_token_id in ids:
            raise ParamError("prompt_token_ids", f"has {ids.count(boi)} image placeholders ({boi}, "
                                                 f"{self.processor.boi_token}) for {len(images)} images: give one "
                                                 f"per image, or the {sum(counts)} expanded image tokens")
        span = tok.encode(self.processor.full_image_sequence, add_special_tokens=False)
        out: list[int] = []
        for t in ids:
            out.extend(span if t == boi else (t,))
        return out
