"""What a processed multimodal request carries per item (vLLM's ``PlaceholderRange`` / ``MultiModalFeatureSpec``).

The engine never looks inside an item: the scheduler reads its placeholder range (where its embeddings go in the
prompt) and its content hash (the encoder cache key, and the prefix cache's extra key for the blocks it covers); the
model runner hands ``data`` (the HF processor's tensors for this one item) to the model's vision encoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class PlaceholderRange:
    """The item's embeddings replace prompt tokens ``offset .. offset + length - 1``."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class MultiModalFeatureSpec:
    """One multimodal item of a request: its processor tensors, modality, content hash and placeholder range."""

    data: dict[str, Any]  # the HF processor's tensors for this item alone (LLaVA: pixel_values [1, 3, H, W])
    modality: str  # "image"
    identifier: str  # content hash of the item's pixels (hex): the encoder cache key, the block hash extra key
    mm_position: PlaceholderRange
    extra: dict[str, Any] = field(default_factory=dict)  # what the processor said about it (original size...)

    @property
    def num_encoder_tokens(self) -> int:
        return self.mm_position.length


def mm_hashes_in(features: Sequence[MultiModalFeatureSpec], start: int, end: int) -> tuple[str, ...]:
    """Hashes of the items whose placeholders overlap prompt tokens ``[start, end)``, in prompt order: the extra
    keys of a prefix-cache block over those tokens (the same image tokens from different pixels never share K/V)."""
    return tuple(f.identifier for f in features if f.mm_position.offset < end and f.mm_position.end > start)
