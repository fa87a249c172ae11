"""Qwen2-VL and Qwen2.5-VL (HF ``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``): the
vision transformer of ``models/qwen2_vl_vision.py`` (2.5's with window attention) and the native Qwen2 decoder
(``causal_lm.CausalLM``) with M-RoPE.

Images reach the decoder as in ``models/llava.py``: the engine encodes each image once (``embed_multimodal``),
keeps the output in its encoder cache and hands each step the rows its chunk covers in ``meta.extra["mm_embeds"]``.
M-RoPE (``multimodal/mrope.py``): a step with image tokens carries their 3-D positions in
``meta.extra["mrope_positions"]``, from which the model builds the step's rotary rows (each frequency from its
``mrope_section`` axis) and runs the backend's rotary hook over them; every other step's positions are the diagonal
ones (all axes equal: plain RoPE at ``index + delta``), so decode runs exactly as the text model does.

Checkpoint names: transformers' v5 layout (``model.visual.*``, ``model.language_model.*``, ``lm_head.*``) and the
Hub layout (``visual.*``, ``model.*``, ``lm_head.*``) both load.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any, Optional

import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import ModelInfo
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.arch import ARCHITECTURES
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.qwen2_vl_vision import Qwen2VisionTransformer
from pagedllm.models.weights import RenamedWeights
from pagedllm.multimodal.mrope import mrope_cos_sin


def qwen2_vl_text_config(config: Any) -> Any:
    """The decoder's HF config: ``text_config`` named as the Qwen2 decoder it is (``qwen2_vl_text`` is M-RoPE over
    Qwen2)."""
    text = copy.copy(config.text_config)
    text.architectures = ["Qwen2ForCausalLM"]
    return text


def qwen2_vl_model_info(config: Any, text_info: ModelInfo) -> ModelInfo:
    from pagedllm.models.info import checkpoint_dtype

    return dataclasses.replace(text_info, architecture=config.architectures[0], dtype=checkpoint_dtype(config))


class Qwen2VLForConditionalGeneration(CausalLM):
    """The Qwen2 decoder of ``config.text_config`` plus ``visual``."""

    uses_mrope = True
    vision_v2_5 = False

    def __init__(self, config: Any, backend: Any):
        text = qwen2_vl_text_config(config)
        super().__init__(text, ARCHITECTURES["Qwen2ForCausalLM"], backend)
        params = getattr(text, "rope_parameters", None) or {}
        if params.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"Qwen2-VL with rope_type {params.get('rope_type')!r} is not supported")
        self.mrope_section = list(params.get("mrope_section", [16, 24, 24]))
        self.visual = Qwen2VisionTransformer(config.vision_config, backend, self.vision_v2_5)
        self.merge = config.vision_config.spatial_merge_size
        self.image_token_id = int(config.image_token_id)
        self.num_image_tokens = 1  # the largest image's tokens (the encoder budget's floor); set by the loader
        self.supports_lora = False
        self.requires_grad_(False)

    def embed_multimodal(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One ``[tokens, hidden]`` embedding per image (each item: its ``pixel_values`` rows and ``image_grid_thw
        [1, 3]``), all images in one tower call: HF's ``get_image_features``."""
        pixels = torch.cat([item["pixel_values"] for item in items]).to(self.dtype)
        grids = torch.cat([item["image_grid_thw"] for item in items]).cpu()
        out = self.visual(pixels, grids)
        return list(out.split((grids.prod(-1) // self.merge ** 2).tolist()))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        mm = meta.extra.get("mm_embeds") if hidden is None else None
        if mm is not None:  # the step's image rows over the token embeddings (HF's masked_scatter)
            rows, embeds = mm
            hidden = self.embed_tokens(input_ids).index_copy(0, rows, embeds.to(self.dtype))
        mpos = meta.extra.get("mrope_positions")
        if mpos is None:  # every token on the diagonal: plain RoPE
            return super().forward(input_ids, positions, meta, hidden)
        h = self.embed_tokens(input_ids) if hidden is None else hidden
        cos_sin = mrope_cos_sin(self.cos_sin_cache, mpos, self.mrope_section)
        rows = torch.arange(h.shape[0], device=h.device)
        for i in range(self.num_layers):
            h = self.layers[i](h, rows, self.kv_caches[i], meta, cos_sin)
        return self.norm(h)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same decoder and M-RoPE; the tower with RMSNorms, a gated MLP and window attention."""

    vision_v2_5 = True


class Qwen2VLWeights(RenamedWeights):
    """A checkpoint of either layout, read under the names the decoder's loader asks for (``model.*`` of a Qwen2
    checkpoint, ``lm_head.weight``, ``model.visual.*``)."""

    def _candidates(self, name: str) -> list[str]:
        if name.startswith("model.visual."):
            return [name, name[len("model."):]]
        if name == "lm_head.weight":
            return [name]
        if name.startswith("model."):
            rest = name[len("model."):]
            return ["model.language_model." + rest, name]
        return [name]


def max_image_tokens(path: str, config: Any) -> int:
    """Placeholder tokens of the largest image the checkpoint's image processor makes (``longest_edge`` pixels;
    HF's default cap when the folder names none)."""
    try:
        with open(os.path.join(path, "preprocessor_config.json")) as f:
            pre = json.load(f)
    except OSError:
        pre = {}
    size = pre.get("size") or {}  # transformers 5 saves size.longest_edge; Hub configs have max_pixels
    pixels = size.get("longest_edge") or size.get("max_pixels") or pre.get("max_pixels") or 12845056
    v = config.vision_config
    return max(1, int(pixels) // (v.patch_size * v.spatial_merge_size) ** 2)


def build_qwen2_vl_model(path: str, config: Any, backend: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """The model with its weights, on ``device`` in ``dtype`` (vision tower too)."""
    from pagedllm.models.loader import eos_token_ids
    from pagedllm.models.rope import build_cos_sin_cache
    from pagedllm.models.weights import SafetensorsWeights, fused_state_dict

    cls = (Qwen2_5_VLForConditionalGeneration if config.architectures[0] == "Qwen2_5_VLForConditionalGeneration"
           else Qwen2VLForConditionalGeneration)
    with torch.device("meta"):
        model = cls(config, backend)
    weights = Qwen2VLWeights(SafetensorsWeights(path))
    sd = fused_state_dict(model, weights, dtype, device)
    model.load_state_dict(sd, strict=True, assign=True)
    text = qwen2_vl_text_config(config)
    model.cos_sin_cache = build_cos_sin_cache(text, model.max_model_len, device, None)
    model.eos_token_ids = eos_token_ids(path, text)
    model.num_image_tokens = max_image_tokens(path, config)
    return model.requires_grad_(False).eval()
