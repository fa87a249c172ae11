"""The rotary cos/sin table, with HF's inverse frequencies so every HF rope type matches."""

from __future__ import annotations

from typing import Any

import torch


def rope_inv_freq(config: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) as HF's rotary modules compute them: the plain RoPE formula for the default
    type (HF keeps it on each model class, whose import costs ~1 s of cold start), ``ROPE_INIT_FUNCTIONS`` for
    scaled types (linear, dynamic, yarn, longrope, llama3, ...)."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config)


def build_cos_sin_cache(config: Any, max_positions: int, device: torch.device) -> torch.Tensor:
    """``[max_positions, rot_dim]`` float32 = cat(cos, sin) * attention_scaling over the rotary half-dim.

    Repeats HF's forward numerics: float32 ``position * inv_freq``. Dynamic types use their un-grown frequencies, as
    HF does up to ``max_position_embeddings``.
    """
    with torch.device("cpu"):
        inv_freq, scaling = rope_inv_freq(config)
    inv_freq = inv_freq.to(device=device, dtype=torch.float32)
    positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * float(scaling), freqs.sin() * float(scaling)), dim=-1)
