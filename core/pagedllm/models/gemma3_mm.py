"""Gemma 3 with vision natively (HF ``Gemma3ForConditionalGeneration``): a SigLIP vision tower (models/siglip.py),
``Gemma3MultiModalProjector`` (average-pool the patch grid to ``mm_tokens_per_image`` tokens, the soft-embedding
RMSNorm, one projection) and the native Gemma 3 text decoder (``causal_lm.CausalLM`` over ``text_config``: sliding
and global layers, each with its rotary base).

The processor expands each ``<start_of_image>`` to ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` soft tokens +
``<end_of_image>\\n\\n``; one image is one item whose placeholder range is its run of soft tokens (HF's
``token_type_ids == 1``). Those tokens attend to each other **bidirectionally** (HF's ``blockwise_overlay``: global
layers ``OR(causal, same image)``, sliding layers ``AND(window, OR(causal, same image))``): the model says
``mm_prefix_lm``, so the engine hands each step's image spans to the attention (``meta.mm_prefix_ranges``, a backend
capability) and never splits an image across chunks or prefix-cache hits (multimodal/prefix_lm.py).

Checkpoint names: transformers' saved layout (``language_model.model.*``, ``vision_tower.*``,
``multi_modal_projector.*``), the Hub's (``vision_tower.vision_model.*``) and the in-memory v5 layout
(``model.language_model.*``, ``model.vision_tower.*``) all load.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import ModelInfo
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.arch import architecture_of
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.siglip import SiglipVisionEmbeddings, SiglipVisionModel
from pagedllm.models.weights import RenamedWeights

GEMMA3_MM_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)


def gemma3_mm_model_info(config: Any, text_info: ModelInfo) -> ModelInfo:
    """The engine's view: the decoder's shapes under the VLM's name and dtype, and its bidirectional image spans
    (a backend without ``Capabilities.mm_prefix_lm`` refuses it at start-up)."""
    from pagedllm.models.info import checkpoint_dtype

    return dataclasses.replace(text_info, architecture=config.architectures[0], dtype=checkpoint_dtype(config),
                               mm_prefix_lm=True)


class Gemma3VisionEmbeddings(SiglipVisionEmbeddings):
    """HF ``SiglipVisionEmbeddings`` at the tower's own size: position ``i`` for patch ``i`` (no NaViT buckets)."""

    def position_ids(self, h: int, w: int, device: torch.device) -> torch.Tensor:
        if h * w != self.num_patches_per_side ** 2:
            raise ValueError(f"pixel_values: {h}x{w} patches, the tower takes {self.num_patches_per_side} per side "
                             "(images are resized to the tower's size)")
        return torch.arange(h * w, device=device)


class Gemma3MultiModalProjector(nn.Module):
    """HF's ``Gemma3MultiModalProjector``: ``[N, patches, d_vision]`` -> ``[N, mm_tokens_per_image, d_text]``."""

    def __init__(self, config: Any, rms_norm: Any):
        super().__init__()
        from pagedllm.models.causal_lm import RMSNorm

        vision = config.vision_config
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size,
                                                                   config.text_config.hidden_size))
        self.mm_soft_emb_norm = RMSNorm(vision.hidden_size, vision.layer_norm_eps, rms_norm, True)
        self.patches_per_image = vision.image_size // vision.patch_size
        tokens_per_side = int(config.mm_tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != config.mm_tokens_per_image or self.patches_per_image % tokens_per_side:
            raise UnsupportedModelError(f"mm_tokens_per_image {config.mm_tokens_per_image} does not pool the tower's "
                                        f"{self.patches_per_image}x{self.patches_per_image} patches evenly")
        self.kernel_size = self.patches_per_image // tokens_per_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, d = x.shape
        grid = x.transpose(1, 2).reshape(n, d, self.patches_per_image, self.patches_per_image)
        pooled = nn.functional.avg_pool2d(grid, self.kernel_size, self.kernel_size).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(CausalLM):
    """The Gemma 3 decoder of ``config.text_config`` plus ``vision_tower`` and ``multi_modal_projector``."""

    mm_prefix_lm = True  # each image's tokens attend to each other (multimodal/prefix_lm.py)

    def __init__(self, config: Any, backend: Any):
        text = config.text_config
        _, spec = architecture_of(text)
        if spec.module != "decoder" or not spec.gemma:
            raise UnsupportedModelError(f"Gemma 3 vision with a {text.model_type} decoder is not supported")
        super().__init__(text, spec, backend)
        vision = config.vision_config
        if getattr(vision, "model_type", "") != "siglip_vision_model" or getattr(vision, "vision_use_head", False):
            raise UnsupportedModelError("Gemma 3 vision needs its SigLIP tower without the pooling head")
        self.vision_tower = SiglipVisionModel(vision, backend)
        self.vision_tower.embeddings = Gemma3VisionEmbeddings(vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(config, backend.rms_norm)
        self.image_token_id = int(config.image_token_id)
        self.tokens_per_image = int(config.mm_tokens_per_image)
        self.supports_lora = False
        self.requires_grad_(False)

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens per image (every image is resized to the tower's size; pan-and-scan off)."""
        return self.tokens_per_image

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` -> ``[N, mm_tokens_per_image, hidden]`` (HF's ``get_image_features``)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values.to(self.dtype)))

    def embed_multimodal(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One ``[mm_tokens_per_image, hidden]`` embedding per image (each item: ``pixel_values [1, C, H, W]``), all
        images in one tower call."""
        return list(self.image_features(torch.cat([item["pixel_values"] for item in items])).unbind(0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        mm = meta.extra.get("mm_embeds") if hidden is None else None
        if mm is not None:  # the soft tokens' rows over the scaled token embeddings (the features are not scaled)
            rows, embeds = mm
            ids = input_ids if self.image_token_id < self.vocab_size else input_ids.clamp(max=self.vocab_size - 1)
            h = self.embed_tokens(ids)
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
            hidden = h.index_copy(0, rows, embeds.to(h.dtype))
        return super().forward(input_ids, positions, meta, hidden)


class Gemma3MMWeights(RenamedWeights):
    """A checkpoint of any Gemma 3 vision layout, read under the names the decoder's loader asks for (``model.*`` of
    a Gemma 3 text checkpoint, ``model.vision_tower.*``, ``model.multi_modal_projector.*``)."""

    def _candidates(self, name: str) -> list[str]:
        for ours, theirs in (("model.vision_tower.", ("vision_tower.vision_model.", "vision_tower.",
                                                      "model.vision_tower.vision_model.", "model.vision_tower.")),
                             ("model.multi_modal_projector.", ("multi_modal_projector.",
                                                               "model.multi_modal_projector."))):
            if name.startswith(ours):
                rest = name[len(ours):]
                return [t + rest for t in theirs]
        if name == "lm_head.weight":
            return ["lm_head.weight", "language_model.lm_head.weight"]
        if name.startswith("model."):
            rest = name[len("model."):]
            return ["language_model.model." + rest, "model.language_model." + rest, "language_model." + rest]
        return [name]


def build_gemma3_mm_model(path: str, config: Any, backend: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """The model with its weights, on ``device`` in ``dtype`` (vision tower and projector too), with the decoder's
    per-layer-type rotary tables."""
    from pagedllm.models.loader import eos_token_ids
    from pagedllm.models.rope import build_cos_sin_cache
    from pagedllm.models.weights import SafetensorsWeights, fused_state_dict

    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(config, backend)
    sd = fused_state_dict(model, Gemma3MMWeights(SafetensorsWeights(path)), dtype, device)
    model.load_state_dict(sd, strict=True, assign=True)
    text = config.text_config
    model.cos_sin_cache = build_cos_sin_cache(text, model.max_model_len, device, None)
    model.rope_caches = {t: build_cos_sin_cache(text, model.max_model_len, device, None, t)
                         for t in sorted(set(text.layer_types))}
    model.eos_token_ids = eos_token_ids(path, text)
    return model.requires_grad_(False).eval()
