"""Idefics3 / SmolVLM natively (HF ``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``): a
SigLIP vision tower (models/siglip.py), the pixel-shuffle connector with its projection, and the native Llama
decoder (``causal_lm.CausalLM`` over ``text_config``).

The processor cuts a large image into ``rows x cols`` tiles plus a global view, each tile ``image_seq_len`` image
tokens framed by ``<fake_token_around_image>`` and a ``<row_r_col_c>`` / ``<global-img>`` marker. One image is one
multimodal item whose placeholder range spans all of that (multimodal/idefics3_processing.py), markers included:
``embed_multimodal`` returns the whole span's embeddings, the tiles' features at the image-token rows and the
markers' own token embeddings between them, so the engine's encoder cache, chunked prefill (a chunk may end inside
a tile or on a marker) and image-hashed prefix blocks work unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.arch import architecture_of
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.siglip import SiglipVisionModel
from pagedllm.models.weights import RenamedWeights

IDEFICS3_ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
MAX_TILES_PER_SIDE = 6  # the processors' <row_6_col_6> is the last marker


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """HF's ``Idefics3Connector.pixel_shuffle``: ``[N, s*s, d]`` -> ``[N, s*s / scale^2, d * scale^2]``."""
    n, seq, d = x.shape
    side = int(seq ** 0.5)
    x = x.view(n, side, side // scale, d * scale).permute(0, 2, 1, 3)
    x = x.reshape(n, side // scale, side // scale, d * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(n, seq // (scale * scale), d * scale * scale)


class Idefics3SimpleMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        d_in = config.vision_config.hidden_size * config.scale_factor ** 2
        self.proj = nn.Linear(d_in, config.text_config.hidden_size, bias=False)


class Idefics3Connector(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.scale_factor = int(config.scale_factor)
        self.modality_projection = Idefics3SimpleMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(x, self.scale_factor))


class Idefics3ForConditionalGeneration(CausalLM):
    """The decoder of ``config.text_config`` plus ``vision_model`` and ``connector``."""

    def __init__(self, config: Any, backend: Any):
        text = config.text_config
        _, spec = architecture_of(text)
        if spec.module != "decoder" or spec.attention != "mha" or spec.gemma:
            raise UnsupportedModelError(f"Idefics3 with a {text.model_type} decoder is not supported (a native "
                                        "Llama-style decoder only)")
        super().__init__(text, spec, backend)
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        if side % config.scale_factor:
            raise UnsupportedModelError(f"scale_factor {config.scale_factor} does not divide the tower's {side} "
                                        "patches per side")
        self.vision_model = SiglipVisionModel(vision, backend)
        self.connector = Idefics3Connector(config)
        self.image_token_id = int(config.image_token_id)
        self.image_seq_len = (side // config.scale_factor) ** 2
        self.tile_size = vision.image_size
        self.supports_lora = False
        self.requires_grad_(False)

    @property
    def num_image_tokens(self) -> int:
        """The most prompt tokens one image can span: 6 x 6 tiles plus the global view, each with its markers."""
        tiles = MAX_TILES_PER_SIDE ** 2 + 1
        return tiles * (self.image_seq_len + 2) + MAX_TILES_PER_SIDE + 2

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles ``[N, C, H, W]`` -> ``[N, image_seq_len, hidden]`` (HF's ``get_image_features`` per tile)."""
        return self.connector(self.vision_model(pixel_values.to(self.dtype)))

    def embed_multimodal(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One ``[span, hidden]`` embedding per image, all tiles of all images in one tower call. Each item holds
        the processor's ``pixel_values [1, tiles, C, H, W]``, ``pixel_attention_mask [1, tiles, H, W]`` and the
        span's token ids (``span_ids``): image-token rows take the tiles' features in order, the marker rows their
        token embeddings."""
        tiles = []
        for item in items:
            pixels = item["pixel_values"].reshape(-1, *item["pixel_values"].shape[-3:])
            mask = item.get("pixel_attention_mask")
            if mask is not None and not bool(mask.all()):
                raise ValueError("pixel_attention_mask: partial tiles are not supported (every tile must be "
                                 f"{self.tile_size}x{self.tile_size}, as the Idefics3/SmolVLM processors make them)")
            tiles.append(pixels)
        feats = self.image_features(torch.cat(tiles)).split([t.shape[0] for t in tiles])
        out = []
        for item, f in zip(items, feats):
            ids = item["span_ids"].to(self.embed_tokens.weight.device)
            rows = (ids == self.image_token_id).nonzero().squeeze(1)
            f = f.reshape(-1, f.shape[-1])
            if rows.numel() != f.shape[0]:
                raise RuntimeError(f"an image of {f.shape[0] // self.image_seq_len} tiles has {rows.numel()} image "
                                   f"tokens (expected {f.shape[0]})")
            out.append(self.embed_tokens(ids).index_copy(0, rows, f.to(self.dtype)))
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        mm = meta.extra.get("mm_embeds") if hidden is None else None
        if mm is not None:  # the step's image spans over the token embeddings (HF's inputs_merger)
            rows, embeds = mm
            hidden = self.embed_tokens(input_ids).index_copy(0, rows, embeds.to(self.dtype))
        return super().forward(input_ids, positions, meta, hidden)


class Idefics3Weights(RenamedWeights):
    """A checkpoint of Idefics3 / SmolVLM (``model.text_model.*``, ``model.vision_model.*``, ``model.connector.*``,
    ``lm_head.*``), read under the names the decoder's loader asks for (``model.*`` of a Llama checkpoint)."""

    def _candidates(self, name: str) -> list[str]:
        if name.startswith(("model.vision_model.", "model.connector.")) or name == "lm_head.weight":
            return [name]
        if name.startswith("model."):
            return ["model.text_model." + name[len("model."):]]
        return [name]


def build_idefics3_model(path: str, config: Any, backend: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """The model with its weights, on ``device`` in ``dtype`` (vision tower and connector too)."""
    from pagedllm.models.loader import eos_token_ids
    from pagedllm.models.rope import build_cos_sin_cache
    from pagedllm.models.weights import SafetensorsWeights, fused_state_dict

    with torch.device("meta"):
        model = Idefics3ForConditionalGeneration(config, backend)
    sd = fused_state_dict(model, Idefics3Weights(SafetensorsWeights(path)), dtype, device)
    model.load_state_dict(sd, strict=True, assign=True)
    model.cos_sin_cache = build_cos_sin_cache(config.text_config, model.max_model_len, device, None)
    model.eos_token_ids = eos_token_ids(path, config.text_config)
    return model.requires_grad_(False).eval()
