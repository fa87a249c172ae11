"""Hook implementations mapping the contract's op hooks onto the Triton kernels.

Device-agnostic: the GPU plugins re-export these, and so can any backend whose tensors Triton can launch on (CPU
tensors too, under ``TRITON_INTERPRET=1``). Kernel modules are imported on first call, so loading a plugin that
re-exports these hooks never imports Triton.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.backend.hookspec import hookimpl


@hookimpl
def pagedllm_write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: Any, slot_mapping: torch.Tensor,
                      k_scale: float, v_scale: float) -> None:
    from pagedllm.backend.triton.kv_write import write_kv  # heavy: triton, loaded on the first kernel call

    write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)


@hookimpl
def pagedllm_paged_attention(query: torch.Tensor, kv_cache: Any, meta, scale: float, sliding_window: Optional[int],
                             soft_cap: Optional[float], k_scale: float, v_scale: float,
                             alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    from pagedllm.backend.triton.attention import paged_attention  # heavy: triton, loaded on the first kernel call

    return paged_attention(query, kv_cache, meta, scale, sliding_window, soft_cap, k_scale=k_scale,
                           v_scale=v_scale, alibi_slopes=alibi_slopes)


@hookimpl
def pagedllm_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from pagedllm.backend.triton.fused_ops import rms_norm  # heavy: triton, loaded on the first kernel call

    return rms_norm(x, weight, eps)


@hookimpl
def pagedllm_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    cos_sin_cache: torch.Tensor) -> tuple:
    from pagedllm.backend.triton.fused_ops import rotary  # heavy: triton, loaded on the first kernel call

    return rotary(positions, query, key, cos_sin_cache)


@hookimpl
def pagedllm_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from pagedllm.backend.triton.fused_ops import silu_and_mul  # heavy: triton, loaded on the first kernel call

    return silu_and_mul(x)


#: The hook functions, for ``from pagedllm.backend.triton.hooks import *`` in a plugin module.
__all__ = ["pagedllm_write_kv", "pagedllm_paged_attention", "pagedllm_rms_norm", "pagedllm_rotary",
           "pagedllm_silu_and_mul"]
