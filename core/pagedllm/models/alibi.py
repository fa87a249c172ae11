"""ALiBi (Press et al.): a per-head linear position bias added to attention scores instead of rotary embeddings.

The slopes are the standard closest-power-of-two geometric sequence, the same numbers as transformers'
``build_alibi_tensor`` (Bloom, Falcon) and Baichuan-13B's ``_get_interleave``; the paged attention hook adds
``slope_h * (k_pos - q_pos)`` (equal, after softmax, to HF's ``slope_h * k_pos``).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """float32 ``[num_heads]``."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** p for p in range(1, 1 + 2 * min(closest, num_heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def uses_alibi(config: Any) -> bool:
    """Whether a checkpoint's native implementation attends with ALiBi (Falcon ``alibi=True``; Baichuan-13B, marked
    ``pagedllm_alibi`` by ``remote_layouts``)."""
    return bool(getattr(config, "alibi", False)) or bool(getattr(config, "pagedllm_alibi", False))
