"""The pre-LN ViT encoder CLIP and SigLIP share (HF ``CLIPEncoder`` / ``SiglipEncoder``): layers of LayerNorm,
attention, residual; LayerNorm, MLP (``fc1``, activation, ``fc2``), residual. models/clip.py and models/siglip.py
add what differs (embeddings, pre/post LayerNorm, which hidden states are read).

Attention is bidirectional within each image (or tile) and goes through the backend's ``encoder_attention`` hook
(varlen, unpaged): the images of a step are one flat batch of ``[images x length]`` rows, image i owning rows
``cu_seqlens[i]:cu_seqlens[i+1]``. q/k/v are fused into one matmul (``qkv_proj``, read from HF's ``q_proj`` /
``k_proj`` / ``v_proj``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


def activation(name: str):
    """transformers' activation of that name (``ACT2FN``)."""
    from transformers.activations import ACT2FN  # heavy: transformers

    return ACT2FN[name]


class VisionAttention(nn.Module):
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


class VisionMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config, backend)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cu_seqlens, max_seqlen)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """``num_layers`` encoder layers (default: the config's all)."""

    def __init__(self, config: Any, backend: Any, num_layers: Optional[int] = None):
        super().__init__()
        count = config.num_hidden_layers if num_layers is None else num_layers
        self.layers = nn.ModuleList(VisionEncoderLayer(config, backend) for _ in range(count))

    def forward(self, x: torch.Tensor, hidden_states: Optional[list[int]] = None):
        """``x`` ``[N, length, hidden]`` (N images of ``length`` rows) -> the last layer's output, the same shape; or,
        given ``hidden_states`` (HF's indices: 0 is ``x``, k the output of layer k), those states in that order."""
        n, length, d = x.shape
        cu = torch.arange(0, (n + 1) * length, length, dtype=torch.int32, device=x.device)
        h = x.reshape(n * length, d)
        states = {0: h}
        for k, layer in enumerate(self.layers, start=1):
            h = layer(h, cu, length)
            if hidden_states is not None and k in hidden_states:
                states[k] = h
        if hidden_states is None:
            return h.view(n, length, d)
        return [states[k].view(n, length, d) for k in hidden_states]
