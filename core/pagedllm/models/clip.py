"""CLIP's vision transformer (HF ``CLIPVisionModel``), the vision tower of LLaVA-style models.

Patch embedding (a stride-``patch_size`` convolution) plus a CLS embedding and learned positions, a pre-LayerNorm,
then the pre-LN encoder layers it shares with SigLIP (models/vision_encoder.py: attention within each image through
the backend's ``encoder_attention`` hook, q/k/v fused into ``qkv_proj``) over ``1 + patches`` rows per image.

Only the layers the caller's feature layer needs are built (LLaVA reads the penultimate layer's output by default),
and the post-LayerNorm (which only HF's pooled output uses) is not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.errors import UnsupportedModelError
from pagedllm.models.vision_encoder import VisionAttention, VisionEncoder, VisionEncoderLayer, VisionMLP


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        d = config.hidden_size
        self.image_size, self.patch_size = config.image_size, config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(d))
        self.patch_embedding = nn.Conv2d(config.num_channels, d, kernel_size=self.patch_size,
                                         stride=self.patch_size, bias=False)
        self.num_positions = (self.image_size // self.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` -> ``[N, 1 + patches, hidden]``."""
        n, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"pixel_values: {h}x{w} images, but the vision tower takes "
                             f"{self.image_size}x{self.image_size}")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.expand(n, 1, -1), patches], dim=1)
        return x + self.position_embedding.weight[None]


# the encoder CLIP shares with SigLIP (models/vision_encoder.py), under CLIP's names
CLIPAttention, CLIPMLP = VisionAttention, VisionMLP
CLIPEncoderLayer, CLIPEncoder = VisionEncoderLayer, VisionEncoder


class CLIPVisionModel(nn.Module):
    """HF's ``CLIPVisionModel`` up to the deepest hidden state the caller reads. ``forward`` returns the hidden states
    ``feature_layers`` asks for (HF's ``hidden_states`` indices: 0 is the pre-LayerNormed embedding, k the output of
    layer k, negative counts from the end of the full tower), each ``[N, 1 + patches, hidden]``."""

    def __init__(self, config: Any, backend: Any, feature_layers: list[int]):
        super().__init__()
        total = config.num_hidden_layers
        self.feature_layers = [layer if layer >= 0 else total + 1 + layer for layer in feature_layers]
        if any(not 0 <= layer <= total for layer in self.feature_layers):
            raise UnsupportedModelError(f"vision_feature_layer {feature_layers} is outside the tower's "
                                        f"{total} layers")
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # (HF's spelling)
        self.encoder = CLIPEncoder(config, backend, max(self.feature_layers))

    @property
    def num_positions(self) -> int:
        return self.embeddings.num_positions

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        return self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)), self.feature_layers)
