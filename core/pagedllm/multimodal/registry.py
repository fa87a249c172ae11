"""Which input modalities a checkpoint accepts, decided from its HF config alone (before any weight is read).

The server and the offline API ask this before accepting an image: a part a model cannot take is refused (HTTP
400 / ``ValueError``), never dropped. A family is listed here only once it runs natively with its encoder.
"""

from __future__ import annotations

from typing import Any

# HF architecture name -> the modalities its native implementation takes besides text
MULTIMODAL_ARCHITECTURES: dict[str, frozenset[str]] = {
    "LlavaForConditionalGeneration": frozenset({"image"}),  # models/llava.py: CLIP tower + projector + decoder
    **dict.fromkeys(("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
                    frozenset({"image"})),  # models/idefics3.py: SigLIP tower + pixel-shuffle connector + decoder
    "Qwen2VLForConditionalGeneration": frozenset({"image"}),  # models/qwen2_vl.py: ViT + Qwen2 decoder, M-RoPE
    "Qwen2_5_VLForConditionalGeneration": frozenset({"image"}),  # models/qwen2_vl.py: + window attention
    # models/gemma3_mm.py: SigLIP tower + pooling projector + Gemma 3 decoder; images attend bidirectionally
    "Gemma3ForConditionalGeneration": frozenset({"image"}),
}

# HF architecture name -> its prompt processor when the generic one (contiguous image-token runs) does not fit
MULTIMODAL_PROCESSORS: dict[str, str] = {
    **dict.fromkeys(("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
                    "pagedllm.multimodal.idefics3_processing:Idefics3MultiModalProcessor"),
    **dict.fromkeys(("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"),
                    "pagedllm.multimodal.qwen_vl:QwenVLProcessor"),
    "Gemma3ForConditionalGeneration": "pagedllm.multimodal.gemma3_processing:Gemma3MultiModalProcessor"}


def processor_class(hf_config: Any) -> type:
    """The :class:`MultiModalProcessor` (sub)class that expands the prompts of the model of ``hf_config``."""
    import importlib

    for arch in getattr(hf_config, "architectures", None) or ():
        if arch in MULTIMODAL_PROCESSORS:
            module, _, name = MULTIMODAL_PROCESSORS[arch].partition(":")
            return getattr(importlib.import_module(module), name)
    from pagedllm.multimodal.processing import MultiModalProcessor

    return MultiModalProcessor


def supported_modalities(hf_config: Any) -> frozenset[str]:
    """The non-text modalities (``"image"``...) the model of ``hf_config`` accepts; empty for a text-only model."""
    out: frozenset[str] = frozenset()
    for arch in getattr(hf_config, "architectures", None) or ():
        out |= MULTIMODAL_ARCHITECTURES.get(arch, frozenset())
    return out
