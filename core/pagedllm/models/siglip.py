"""SigLIP's vision transformer as Idefics3 / SmolVLM use it (HF ``Idefics3VisionTransformer``, NaViT-style
position buckets), the vision tower of models/idefics3.py.

A stride-``patch_size`` convolution, learned positions (a tile of ``h x w`` patches reads the ``n x n`` position
table at bucketed fractional coordinates, HF's ``Idefics3VisionEmbeddings``), pre-LN encoder layers and a final
LayerNorm. There is no CLS row. The encoder layers are the ones SigLIP shares with CLIP (models/vision_encoder.py:
attention within each tile through the backend's ``encoder_attention`` hook, q/k/v fused into ``qkv_proj``).

Every tile must be whole (HF's ``patch_attention_mask`` all true): the Idefics3/SmolVLM image processors resize
each tile to the tower's square size, so padded patches only occur in HF's batch padding (whole zero tiles, which
the caller drops).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.models.vision_encoder import VisionAttention, VisionEncoder, VisionEncoderLayer, VisionMLP


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        d = config.hidden_size
        self.patch_size = config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, d, kernel_size=self.patch_size,
                                         stride=self.patch_size)
        self.num_patches_per_side = config.image_size // self.patch_size
        self.position_embedding = nn.Embedding(self.num_patches_per_side ** 2, d)

    def position_ids(self, h: int, w: int, device: torch.device) -> torch.Tensor:
        """HF's bucketed position ids of a whole ``h x w``-patch tile (``[h * w]``)."""
        n = self.num_patches_per_side
        boundaries = torch.arange(1 / n, 1.0, 1 / n, device=device)
        rows = torch.clamp(torch.arange(h, device=device, dtype=torch.float32) * (1.0 / h), max=1.0 - 1e-6)
        cols = torch.clamp(torch.arange(w, device=device, dtype=torch.float32) * (1.0 / w), max=1.0 - 1e-6)
        rows = torch.bucketize(rows, boundaries, right=True)
        cols = torch.bucketize(cols, boundaries, right=True)
        return (rows[:, None] * n + cols[None, :]).reshape(-1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` -> ``[N, patches, hidden]``."""
        _, _, h, w = pixel_values.shape
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        pos = self.position_ids(h // self.patch_size, w // self.patch_size, x.device)
        return x + self.position_embedding(pos)[None]


# the encoder SigLIP shares with CLIP (models/vision_encoder.py), under SigLIP's names
SiglipAttention, SiglipMLP = VisionAttention, VisionMLP
SiglipEncoderLayer, SiglipEncoder = VisionEncoderLayer, VisionEncoder


class SiglipVisionModel(nn.Module):
    """``forward``: tiles ``[N, C, H, W]`` -> the post-LayerNormed last hidden state ``[N, patches, hidden]``."""

    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = SiglipEncoder(config, backend)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))
