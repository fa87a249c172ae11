"""Varlen, unpaged encoder attention (``pagedllm_encoder_attention``): one fused CPU SDPA call per sequence.

Measured against a packed block-diagonal mask over the whole batch and a padded ``[B, max_len]`` batch with a key
mask (docs/cpu-backend.md): per sequence wins on every shape tried (its cost grows with the sum of ``L^2``, the
packed mask's with ``T^2``, and padding pays for the longest). Inputs go in 4-D (``[1, H, L, D]``): torch routes
3-D inputs to its unfused math path, twice as slow in float32 and up to 8x in bfloat16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int, scale: float, causal: bool) -> torch.Tensor:
    """See ``pagedllm.backend.hookspec.pagedllm_encoder_attention``; padding rows past ``cu_seqlens[-1]`` are
    zero."""
    out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
    gqa = query.shape[1] != key.shape[1]
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        q, k, v = (x[None, start:end].transpose(1, 2) for x in (query, key, value))  # [1, H, L, D] views
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)
    return out
