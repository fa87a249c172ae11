"""PrefixLM image spans (vLLM's ``mm_prefix_range``): models such as Gemma 3 with vision attend bidirectionally
among the tokens of one image (HF's ``token_type_ids`` / ``blockwise_overlay``) while text stays causal.

A span's later tokens are visible to its earlier ones, so its K/V is right only if the whole span is computed in one
forward pass. Three rules keep it so, for a model whose ``mm_prefix_lm`` is true:

- scheduling (``whole_spans``): a prefill chunk never ends inside a span; it is cut back to the span's start (the
  span runs whole in a later step). The engine refuses a token budget smaller than one image
  (``check_token_budget``): such an image could never be scheduled;
- prefix caching (``trim_hits``): a cache hit never ends inside a span, so a span's tokens are always computed in
  one pass. (Conservative: a cached span prefix was itself computed with its whole span visible, so its K/V is what
  a full recompute gives -- checked against HF with the trim off -- but the rule keeps every span one pass);
- the step (``step_prefix_ranges``): each sequence's spans go to the attention as ``meta.mm_prefix_ranges``.
"""

from __future__ import annotations

from typing import Any, Sequence

from pagedllm.errors import ParamError
from pagedllm.multimodal.encoder_cache import features_of


def image_spans(request: Any) -> list[tuple[int, int]]:
    """``[start, end)`` prompt positions of each image's placeholder tokens, in prompt order."""
    return [(f.mm_position.offset, f.mm_position.end) for f in features_of(request) if f.modality == "image"]


def check_token_budget(max_num_batched_tokens: int, num_image_tokens: int) -> None:
    """A step must hold one whole image: refused at start-up, naming the field, when it cannot."""
    if max_num_batched_tokens < num_image_tokens:
        raise ParamError("max_num_batched_tokens", f"{max_num_batched_tokens} is less than one image's "
                                                   f"{num_image_tokens} tokens: this model attends bidirectionally "
                                                   "within each image, so an image is never split across steps")


def whole_spans(request: Any, num_computed: int, num_new: int) -> int:
    """``num_new`` cut so that the chunk ``[num_computed, num_computed + num_new)`` ends outside every span; 0: the
    request waits for a step with room for the span."""
    end = num_computed + num_new
    for lo, hi in image_spans(request):
        if lo < end < hi:
            if lo > num_computed:
                return lo - num_computed  # the text before the span now, the span whole later
            return hi - num_computed if lo < num_computed else 0  # (began already, e.g. a connector load: finish it)
    return num_new


def trim_hits(request: Any, hits: Sequence[Any], num_hit: int, block_size: int) -> tuple[list[Any], int]:
    """Prefix-cache ``hits`` (blocks) cut back to the block holding a span's start when they end inside it."""
    for lo, hi in image_spans(request):
        if lo < num_hit < hi:
            keep = lo // block_size
            return list(hits[:keep]), keep * block_size
    return list(hits), num_hit


def step_prefix_ranges(batch: Sequence[Any]) -> list[list[tuple[int, int]]]:
    """Per scheduled sequence (in the step's order), the spans its chunk's queries fall in."""
    out = []
    for s in batch:
        lo, hi = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        out.append([(a, b) for a, b in image_spans(s.request) if a < hi and b > lo])
    return out
