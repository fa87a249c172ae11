"""Triton kernel: scatter new keys/values into paged KV-cache slots (canonical layout), skipping slot -1."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.backend.triton import next_pow2
from pagedllm.backend.triton.fp8 import FORMATS, encode_fp8


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     v_offset, stride_slot, stride_ch,
                     num_kv_heads, head_size, inv_k_scale, inv_v_scale,
                     HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, FP8: tl.constexpr = False,
                     MANT: tl.constexpr = 3, BIAS: tl.constexpr = 7, FMAX: tl.constexpr = 448.0):
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
    if FP8:  # the cache arrives as its uint8 view (fp8.py says why)
        tl.store(dst, encode_fp8(k, inv_k_scale, MANT, BIAS, FMAX).to(tl.uint8), mask=mask)
        tl.store(dst + v_offset, encode_fp8(v, inv_v_scale, MANT, BIAS, FMAX).to(tl.uint8), mask=mask)
    else:
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + v_offset, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store ``[T, Hkv, D]`` keys/values at flat slots of ``kv_cache`` ``[2, blocks, block_size, Hkv, D]``; an fp8
    cache gets ``saturate(x * (1 / scale))`` (``pagedllm.backend.kv_quant``), bit for bit.

    One program per token; no host synchronisation, so it can be captured in a graph."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert kv_cache.stride(4) == 1 and kv_cache.stride(1) == kv_cache.shape[2] * kv_cache.stride(2), \
        "kv_cache must be in the canonical contiguous layout"
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    fmt = FORMATS.get(kv_cache.dtype)
    fp8 = dict(FP8=True, MANT=fmt[0], BIAS=fmt[1], FMAX=fmt[2]) if fmt is not None else {}
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache.view(torch.uint8) if fmt is not None else kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        num_kv_heads, head_size, 1.0 / k_scale, 1.0 / v_scale,
        HEADS_PAD=next_pow2(num_kv_heads), HEAD_PAD=next_pow2(head_size), **fp8)
