"""The rotary cos/sin table, with HF's inverse frequencies so every HF rope type matches."""

from __future__ import annotations

from typing import Any

import torch


def per_layer_type(config: Any) -> bool:
    """Gemma 3: ``rope_parameters`` holds one entry per layer type (local base frequency on sliding layers)."""
    params = getattr(config, "rope_parameters", None) or {}
    return isinstance(params.get("full_attention"), dict)


def rope_inv_freq(config: Any, max_model_len: int | None = None,
                  layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) as HF's rotary modules compute them: the plain RoPE formula for the default
    type (HF keeps it on each model class, whose import costs ~1 s of cold start), ``ROPE_INIT_FUNCTIONS`` for
    scaled types (linear, dynamic, yarn, longrope, llama3, ...).

    LongRoPE (Phi-3 ``su``/``longrope``): HF picks the short or long factors per forward, from the longest position
    in it; a paged cache must not mix them, so the engine picks once: short factors when ``max_model_len`` fits the
    ``original_max_position_embeddings`` (identical to HF there), long ones for every position otherwise (identical
    to HF for a sequence run past that length in one forward)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # heavy: transformers

    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings") or config.max_position_embeddings
        if max_model_len is not None and max_model_len > original:
            return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=original + 1)
    if layer_type is not None:
        return ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


def build_cos_sin_cache(config: Any, max_positions: int, device: torch.device,
                        max_model_len: int | None = None, layer_type: str | None = None) -> torch.Tensor:
    """``[max_positions, rot_dim]`` float32 = cat(cos, sin) * attention_scaling over the rotary half-dim.

    Repeats HF's forward numerics: float32 ``position * inv_freq``. Dynamic types use their un-grown frequencies, as
    HF does up to ``max_position_embeddings``.
    """
    with torch.device("cpu"):
        inv_freq, scaling = rope_inv_freq(config, max_model_len if max_model_len is not None else max_positions,
                                          layer_type)
    inv_freq = inv_freq.to(device=device, dtype=torch.float32)
    positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * float(scaling), freqs.sin() * float(scaling)), dim=-1)
