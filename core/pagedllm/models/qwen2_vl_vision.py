"""The vision transformers of Qwen2-VL (HF ``Qwen2VisionTransformerPretrainedModel``) and Qwen2.5-VL (HF
``Qwen2_5_VisionTransformerPretrainedModel``).

Images arrive as the image processor made them: flat rows of ``C x temporal_patch x patch x patch`` pixels, one row
per patch, patches ordered block-major over ``spatial_merge_size``-square blocks, and each image's ``grid_thw``.
The patch embedding (HF's Conv3d with stride = kernel) is one matmul over those rows; the blocks are pre-LN
(LayerNorm, attention with 2-D rotary over (row, column) of the patch, residual; LayerNorm, MLP, residual), and the
patch merger concatenates each merge block's patches (LayerNorm, MLP) into one token of the decoder's width.

Attention is bidirectional within each image frame and goes through the backend's ``encoder_attention`` hook
(varlen, unpaged): the step's images are one flat batch, each frame a sequence of ``cu_seqlens``. The 2-D rotary
goes through the backend's ``rotary`` hook with a per-patch cos/sin table (positions ``0..N-1``).

Qwen2.5-VL differs in RMSNorms, a gated (SwiGLU, biased) MLP, and **window attention**: the patch rows are first
reordered window by window (``window_size`` pixels square, in whole merge blocks: transformers'
``get_vision_window_index``), every block but those of ``fullatt_block_indexes`` attends within its window (each
window one sequence of ``cu_seqlens``), the full-attention blocks within the whole frame, and the merged tokens are
put back in raster order at the end.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.causal_lm import RMSNorm


def _activation(name: str):
    from transformers.activations import ACT2FN  # heavy: transformers

    return ACT2FN[name]


def vision_rope_table(grid_thw: torch.Tensor, merge: int, head_dim: int, theta: float,
                      device: torch.device) -> torch.Tensor:
    """``[patches, head_dim]`` = cat(cos, sin) over the half-dim of each patch's (row, column) angles: HF's axial
    rotary (``head_dim / 4`` frequencies each for the row and the column), in the backend rotary table layout."""
    from transformers.vision_utils import get_vision_position_ids  # heavy: transformers

    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
    pos = get_vision_position_ids(grid_thw.cpu(), merge).to(device)  # [patches, 2] (row, column)
    freqs = (pos[..., None].float() * inv_freq).flatten(1)  # [patches, head_dim / 2]: row freqs then column freqs
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def frame_cu_seqlens(grid_thw: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` of every frame (one attention sequence each) and the longest."""
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)).to(device)
    return cu, int(lengths.max())


class PatchEmbed(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        k = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.embed_dim, kernel_size=k, stride=k, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[patches, C * T * P * P]`` -> ``[patches, embed_dim]`` (the convolution's one output per patch)."""
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.flatten(1))


class VisionAttention(nn.Module):
    def __init__(self, config: Any, backend: Any, d: int):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_size = d // self.num_heads
        self.scale = self.head_size ** -0.5
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.encoder_attention, self.rotary = backend.encoder_attention, backend.rotary

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, rope: tuple) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.num_heads, self.head_size).unbind(1)
        q, k = self.rotary(rope[0], q, k, rope[1])
        out = self.encoder_attention(q, k, v, cu_seqlens, max_seqlen, self.scale, False)
        return self.proj(out.reshape(t, -1))


class VisionMlp(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        hidden = int(config.embed_dim * config.mlp_ratio)
        self.fc1 = nn.Linear(config.embed_dim, hidden)
        self.act = _activation(config.hidden_act)
        self.fc2 = nn.Linear(hidden, config.embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedVisionMlp(nn.Module):
    """Qwen2.5-VL's: ``down(act(gate(x)) * up(x))``, all biased."""

    def __init__(self, config: Any):
        super().__init__()
        d, hidden = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, hidden)
        self.up_proj = nn.Linear(d, hidden)
        self.down_proj = nn.Linear(hidden, d)
        self.act = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(d: int, rms: bool, backend: Any) -> nn.Module:
    if rms:
        return RMSNorm(d, 1e-6, backend.rms_norm)
    return nn.LayerNorm(d, eps=1e-6)


class VisionBlock(nn.Module):
    def __init__(self, config: Any, backend: Any, d: int, v2_5: bool):
        super().__init__()
        self.norm1 = _norm(d, v2_5, backend)
        self.norm2 = _norm(d, v2_5, backend)
        self.attn = VisionAttention(config, backend, d)
        self.mlp = GatedVisionMlp(config) if v2_5 else VisionMlp(config)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, rope: tuple) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, max_seqlen, rope)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: Any, backend: Any, d: int, out: int, v2_5: bool):
        super().__init__()
        self.width = d * config.spatial_merge_size ** 2
        self.ln_q = _norm(d, v2_5, backend)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2VisionTransformer(nn.Module):
    """``forward(pixel rows, grid_thw)`` -> ``[patches / merge^2, decoder hidden]``, images in order. ``v2_5``:
    Qwen2.5-VL's tower (RMSNorms, gated MLP, window attention)."""

    def __init__(self, config: Any, backend: Any, v2_5: bool = False):
        super().__init__()
        d = config.hidden_size if v2_5 else config.embed_dim
        out = config.out_hidden_size if v2_5 else config.hidden_size
        self.v2_5 = v2_5
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.window_size = getattr(config, "window_size", 0)
        self.full_blocks = set(getattr(config, "fullatt_block_indexes", None) or ()) if v2_5 else None
        self.head_size = d // config.num_heads
        params = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(params.get("rope_theta", 10000.0))
        if v2_5:  # (HF's patch embedding reads embed_dim from hidden_size here)
            config = copy.copy(config)
            config.embed_dim = d
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config, backend, d, v2_5) for _ in range(config.depth))
        self.merger = PatchMerger(config, backend, d, out, v2_5)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        h = self.patch_embed(pixels)
        table = vision_rope_table(grid_thw, self.spatial_merge_size, self.head_size, self.rope_theta, h.device)
        rope = (torch.arange(h.shape[0], device=h.device), table)
        cu, max_len = frame_cu_seqlens(grid_thw, h.device)
        if not self.v2_5:
            for block in self.blocks:
                h = block(h, cu, max_len, rope)
            return self.merger(h)
        from transformers.vision_utils import get_vision_window_index  # heavy: transformers

        window_index, cu_win = get_vision_window_index(grid_thw.cpu(), self.spatial_merge_size, self.window_size,
                                                       self.patch_size)
        unit = self.spatial_merge_size ** 2
        order = (window_index[:, None] * unit + torch.arange(unit)).flatten().to(h.device)  # patch rows, by window
        h, rope = h[order], (rope[0], table[order])
        cu_win = cu_win.to(h.device)
        max_win = int((cu_win[1:] - cu_win[:-1]).max())
        for i, block in enumerate(self.blocks):
            h = block(h, cu, max_len, rope) if i in self.full_blocks else block(h, cu_win, max_win, rope)
        return self.merger(h)[torch.argsort(window_index).to(h.device)]
