"""CLIP's vision transformer (HF ``CLIPVisionModel``), the vision tower of LLaVA-style models.

Patch embedding (a stride-``patch_size`` convolution) plus a CLS embedding and learned positions, a pre-LayerNorm,
then pre-LN encoder layers (LayerNorm, attention, residual; LayerNorm, MLP, residual). Attention is bidirectional
within each image and goes through the backend's ``encoder_attention`` hook (varlen, unpaged): the images of a step
are one flat batch of ``[images x (1 + patches)]`` rows, image i owning rows ``cu_seqlens[i]:cu_seqlens[i+1]``.
q/k/v are fused into one matmul (``qkv_proj``, read from HF's ``q_proj`` / ``k_proj`` / ``v_proj``).

Only the layers the caller's feature layer needs are built (LLaVA reads the penultimate layer's output by default),
and the post-LayerNorm (which only HF's pooled output uses) is not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.errors import UnsupportedModelError


def _activation(name: str):
    from transformers.activations import ACT2FN  # heavy: transformers

    return ACT2FN[name]


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


class CLIPAttention(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_size = d // self.num_heads
        self.scale = self.head_size ** -0.5
        self.qkv_proj = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)
        self.encoder_attention = backend.encoder_attention

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, 3, self.num_heads, self.head_size).unbind(1)
        out = self.encoder_attention(q, k, v, cu_seqlens, max_seqlen, self.scale, False)
        return self.out_proj(out.reshape(t, self.num_heads * self.head_size))


class CLIPMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = CLIPAttention(config, backend)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cu_seqlens, max_seqlen)
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: Any, backend: Any, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config, backend) for _ in range(num_layers))


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
        n = pixel_values.shape[0]
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        length = x.shape[1]
        cu = torch.arange(0, (n + 1) * length, length, dtype=torch.int32, device=x.device)
        h = x.reshape(n * length, -1)
        states = {0: h}
        for k, layer in enumerate(self.encoder.layers, start=1):
            h = layer(h, cu, length)
            states[k] = h
        return [states[layer].view(n, length, -1) for layer in self.feature_layers]
