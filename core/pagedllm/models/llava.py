"""LLaVA-style vision-language models (HF ``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer
projector, and the native decoder (``causal_lm.CausalLM``, any family ``architecture_of`` knows for the text config:
Llama, Mistral, Qwen2...).

The decoder is unchanged: images reach it as embeddings written over the token embeddings at their placeholder
rows. The engine encodes each image once (``embed_multimodal``), keeps the output in its encoder cache
(``pagedllm.multimodal``) and hands each step the rows its chunk covers in ``meta.extra["mm_embeds"]``, so a chunk
may start or end inside an image. Decode steps and text-only prompts run exactly as the text model does.

Checkpoint names: transformers' saved layout (``language_model.model.*``, ``language_model.lm_head.*``,
``vision_tower.*``, ``multi_modal_projector.*``), the in-memory v5 layout (``model.language_model.*``,
``model.vision_tower.*``, ``lm_head.*``) and the llava-hf Hub layout (``vision_tower.vision_model.*``) all load.
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
from pagedllm.models.clip import CLIPVisionModel
from pagedllm.models.weights import RenamedWeights

def text_config_of(config: Any) -> Any:
    """The decoder's HF config of a LLaVA config (its ``text_config``; when it names no architecture,
    ``architecture_of`` maps its ``model_type``)."""
    return config.text_config


def llava_model_info(config: Any, text_info: ModelInfo) -> ModelInfo:
    """The engine's view of a LLaVA checkpoint: its decoder's shapes under the VLM's name and dtype."""
    from pagedllm.models.info import checkpoint_dtype

    return dataclasses.replace(text_info, architecture=config.architectures[0], dtype=checkpoint_dtype(config))


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: Any, num_feature_layers: int):
        super().__init__()
        from transformers.activations import ACT2FN  # heavy: transformers

        bias = getattr(config, "multimodal_projector_bias", True)
        d_text = config.text_config.hidden_size
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * num_feature_layers, d_text, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(d_text, d_text, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(CausalLM):
    """The decoder of ``config.text_config`` plus ``vision_tower`` and ``multi_modal_projector``."""

    def __init__(self, config: Any, backend: Any):
        text = text_config_of(config)
        _, spec = architecture_of(text)
        if spec.module != "decoder" or spec.attention != "mha" or spec.gemma:  # (Gemma scales inputs_embeds too)
            raise UnsupportedModelError(f"LLaVA with a {text.model_type} decoder is not supported (a native "
                                        "Llama-style decoder only)")
        super().__init__(text, spec, backend)
        if getattr(config.vision_config, "model_type", "") != "clip_vision_model":
            raise UnsupportedModelError(f"LLaVA with a {config.vision_config.model_type} vision tower is not "
                                        "supported (CLIP only)")
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not supported")
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        self.llava_config = config
        self.drop_cls = strategy == "default"  # "default" drops the CLS row, "full" keeps it
        self.vision_tower = CLIPVisionModel(config.vision_config, backend, layers)
        self.multi_modal_projector = LlavaMultiModalProjector(config, len(layers))
        self.image_token_id = int(config.image_token_id)
        self.supports_lora = False
        self.requires_grad_(False)

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens per image (every image is resized and cropped to the tower's size)."""
        return self.vision_tower.num_positions - self.drop_cls

    def embed_multimodal(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One ``[tokens, hidden]`` embedding per image (each item: the processor's ``pixel_values [1, C, H, W]``),
        all images in one tower call: HF's ``get_image_features``."""
        pixels = torch.cat([item["pixel_values"] for item in items]).to(self.dtype)
        states = self.vision_tower(pixels)
        if self.drop_cls:
            states = [s[:, 1:] for s in states]
        feats = self.multi_modal_projector(torch.cat(states, dim=-1))
        return list(feats.unbind(0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        mm = meta.extra.get("mm_embeds") if hidden is None else None
        if mm is not None:  # the step's image rows over the token embeddings (HF's masked_scatter)
            rows, embeds = mm
            hidden = self.embed_tokens(input_ids).index_copy(0, rows, embeds.to(self.dtype))
        return super().forward(input_ids, positions, meta, hidden)


class LlavaWeights(RenamedWeights):
    """A checkpoint of any LLaVA layout, read under the names the decoder's loader asks for (``model.*`` of a
    Llama checkpoint, ``lm_head.weight``, ``model.vision_tower.*``, ``model.multi_modal_projector.*``)."""

    def _candidates(self, name: str) -> list[str]:
        for ours, theirs in (("model.vision_tower.", ("model.vision_tower.", "model.vision_tower.vision_model.",
                                                       "vision_tower.", "vision_tower.vision_model.")),
                             ("model.multi_modal_projector.", ("model.multi_modal_projector.",
                                                               "multi_modal_projector."))):
            if name.startswith(ours):
                rest = name[len(ours):]
                return [t + rest for t in theirs]
        if name == "lm_head.weight":
            return ["lm_head.weight", "language_model.lm_head.weight"]
        if name.startswith("model."):
            rest = name[len("model."):]
            return ["model.language_model." + rest, "language_model.model." + rest, "language_model." + rest]
        return [name]


def build_llava_model(path: str, config: Any, backend: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """The model with its weights, on ``device`` in ``dtype`` (vision tower and projector too)."""
    from pagedllm.models.loader import eos_token_ids
    from pagedllm.models.rope import build_cos_sin_cache
    from pagedllm.models.weights import SafetensorsWeights, fused_state_dict

    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config, backend)
    weights = LlavaWeights(SafetensorsWeights(path))
    sd = fused_state_dict(model, weights, dtype, device)
    model.load_state_dict(sd, strict=True, assign=True)
    text = text_config_of(config)
    model.cos_sin_cache = build_cos_sin_cache(text, model.max_model_len, device, None)
    model.eos_token_ids = eos_token_ids(path, text)
    return model.requires_grad_(False).eval()
