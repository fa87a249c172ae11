"""The rotary cos/sin table, built from HF's own rotary embedding so every HF rope type matches."""

from __future__ import annotations

from typing import Any

import torch


def build_cos_sin_cache(config: Any, rotary_cls: type, max_positions: int, device: torch.device) -> torch.Tensor:
    """``[max_positions, rot_dim]`` float32 = cat(cos, sin) * attention_scaling over the rotary half-dim.

    HF's rotary module computes ``inv_freq`` and ``attention_scaling`` (``ROPE_INIT_FUNCTIONS`` for scaled types,
    its own default otherwise); the table then repeats HF's forward numerics: float32 ``position * inv_freq``.
    Dynamic types use their un-grown frequencies, as HF does up to ``max_position_embeddings``.
    """
    with torch.device("cpu"):
        rotary = rotary_cls(config)
    inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
    scaling = float(rotary.attention_scaling)
    positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
