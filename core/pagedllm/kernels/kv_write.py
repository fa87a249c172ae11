"""Triton kernel: scatter new keys/values into paged KV-cache slots (canonical layout), skipping slot -1."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels import next_pow2


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     v_offset, stride_slot, stride_ch,
                     num_kv_heads, head_size,
                     HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_size)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + slot * stride_slot + h * stride_ch + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + v_offset, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``[T, Hkv, D]`` keys/values at flat slots of ``kv_cache`` ``[2, blocks, block_size, Hkv, D]``.

    One program per token; no host synchronisation, so it can be captured in a graph."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert kv_cache.stride(4) == 1 and kv_cache.stride(1) == kv_cache.shape[2] * kv_cache.stride(2), \
        "kv_cache must be in the canonical contiguous layout"
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        num_kv_heads, head_size,
        HEADS_PAD=next_pow2(num_kv_heads), HEAD_PAD=next_pow2(head_size))
