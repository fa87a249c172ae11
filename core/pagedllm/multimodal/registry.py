"""Which input modalities a checkpoint accepts, decided from its HF config alone (before any weight is read).

The server and the offline API ask this before accepting an image: a part a model cannot take is refused (HTTP
400 / ``ValueError``), never dropped. A family is listed here only once it runs natively with its encoder.
"""

from __future__ import annotations

from typing import Any

# HF architecture name -> the modalities its native implementation takes besides text
MULTIMODAL_ARCHITECTURES: dict[str, frozenset[str]] = {
    "LlavaForConditionalGeneration": frozenset({"image"}),  # models/llava.py: CLIP tower + projector + decoder
    "Qwen2VLForConditionalGeneration": frozenset({"image"}),  # models/qwen2_vl.py: ViT + Qwen2 decoder, M-RoPE
    "Qwen2_5_VLForConditionalGeneration": frozenset({"image"}),  # models/qwen2_vl.py: + window attention
}


def supported_modalities(hf_config: Any) -> frozenset[str]:
    """The non-text modalities (``"image"``...) the model of ``hf_config`` accepts; empty for a text-only model."""
    out: frozenset[str] = frozenset()
    for arch in getattr(hf_config, "architectures", None) or ():
        out |= MULTIMODAL_ARCHITECTURES.get(arch, frozenset())
    return out
