"""Triton paged attention over the canonical KV layout, for a flat batch of decodes and prefill chunks.

One kernel serves every case (after vLLM's unified Triton attention, written afresh for our layout): a program
owns ``BLOCK_M`` rows = ``block_q`` consecutive query tokens of one sequence x the ``group`` query heads sharing one
KV head (GQA packing keeps ``tl.dot`` tiles full even for single-token decodes), walks that sequence's keys in tiles
of ``TILE`` positions through the block table, and keeps an online softmax in fp32. With ``NUM_SEGMENTS > 1`` the
key range is split across programs (split-K / flash-decoding) and ``_reduce_segments_kernel`` merges the partial
results; the launcher picks that for small decode-only batches, where one program per (sequence, KV head) would
leave the device idle. Lengths are read from device tensors only, so launches can be captured in device graphs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.triton import interpreting, next_pow2
from pagedllm.backend.triton.fp8 import FORMATS, decode_fp8


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)  # exp overflow gives +-1, never NaN


@triton.jit
def _find_seq(qsl_ptr, q_block, num_seqs, block_q):
    """Sequence owning global q block ``q_block``; sequence i's blocks start at ``qsl[i] // block_q + i``."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // block_q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs"])  # it seeds a loop-carried value in _find_seq: keep it a runtime i32
def _paged_attention_kernel(
        out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
        part_acc_ptr, part_max_ptr, part_sum_ptr, alibi_ptr,
        scale, soft_cap, window, v_scale,
        num_seqs, num_heads, group, head_size, block_size, block_q,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kv, stride_blk, stride_slot, stride_ch, stride_bt,
        HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
        USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, USE_ALIBI: tl.constexpr, UPCAST: tl.constexpr, FP32_DOT: tl.constexpr,
        KV_FP8: tl.constexpr = False, MANT: tl.constexpr = 3, BIAS: tl.constexpr = 7):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_seq(qsl_ptr, q_block, num_seqs, block_q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    local = q_block - (q_start // block_q + seq)
    if local * block_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # cached tokens before this chunk

    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_PAD)
    q_idx = local * block_q + rows // group  # token index inside the chunk
    head = kv_head * group + rows % group
    row_ok = (rows < block_q * group) & (q_idx < q_len)
    d_ok = d < head_size
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx + q_idx
    if USE_ALIBI:  # per-row slope; the bias slope * (k_pos - q_pos) is added after the soft cap, as the reference does
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32)

    # Keys visible to this q block: [k_lo, k_hi), split evenly in tiles across segments.
    k_hi = tl.minimum(ctx + (local + 1) * block_q, seq_len)
    k_lo = 0
    if USE_WINDOW:
        k_lo = tl.maximum(ctx + local * block_q - window + 1, 0)
    tile_lo = k_lo // TILE
    tile_hi = tl.cdiv(k_hi, TILE)
    per_seg = tl.cdiv(tile_hi - tile_lo, NUM_SEGMENTS)
    seg_lo = tile_lo + segment * per_seg
    seg_hi = tl.minimum(seg_lo + per_seg, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    cache_base = cache_ptr + kv_head * stride_ch
    bt_base = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(seg_lo, seg_hi):
        k_pos = tile * TILE + tl.arange(0, TILE)
        # (k_lo: a tile may start before the window, where a freed block's table entry names block 0)
        k_ok = (k_pos < k_hi) & (k_pos >= k_lo)
        blk = tl.load(bt_base + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        slot_off = blk * stride_blk + (k_pos % block_size) * stride_slot
        # Masked loads: slots past the context may hold NaN (never-written blocks), and 0 * NaN is NaN.
        kt = tl.load(cache_base + slot_off[None, :] + d[:, None], mask=d_ok[:, None] & k_ok[None, :], other=0.0)
        v = tl.load(cache_base + stride_kv + slot_off[:, None] + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if KV_FP8:  # uint8 view of an fp8 cache: decoded exactly; k_scale is folded into `scale`, v_scale below
            kt = decode_fp8(kt, MANT, BIAS).to(q.dtype)
            v = decode_fp8(v, MANT, BIAS).to(q.dtype)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        if FP32_DOT:  # exact fp32 products (no TF32), as the reference computes
            s = tl.dot(q, kt, input_precision="ieee") * scale
        else:
            s = tl.dot(q, kt) * scale
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        if USE_ALIBI:
            s = s + slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        allowed = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # fully masked rows stay finite
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if KV_FP8:
        acc = acc * v_scale
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SEGMENTS == 1:
        o = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (token * num_heads + head) * NUM_SEGMENTS + segment
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc, mask=out_mask)
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)


@triton.jit
def _reduce_segments_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                            num_heads, head_size, stride_ot, stride_oh,
                            HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr):
    """Merge the per-segment (acc, max, sum) of one (token, head) with the log-sum-exp rule."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seg = tl.arange(0, NUM_SEGMENTS)
    d = tl.arange(0, HEAD_PAD)
    base = (t * num_heads + h) * NUM_SEGMENTS
    m = tl.load(part_max_ptr + base + seg)
    total_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - total_max), 0.0)  # empty segments weigh nothing
    total = tl.sum(tl.load(part_sum_ptr + base + seg) * w, 0)
    d_ok = d < head_size
    acc = tl.load(part_acc_ptr + (base + seg)[:, None] * HEAD_PAD + d[None, :], mask=d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / total
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def default_num_segments(meta: AttentionMetadata, num_kv_heads: int) -> int:
    """Split-K only for decode-only batches too small to fill the device (graph-safe: shapes only)."""
    if meta.max_query_len != 1:
        return 1
    num_seqs = meta.seq_lens.shape[0]
    if interpreting():
        return 4  # the interpreter costs ~ms per program: keep grids tiny
    return 16 if num_seqs * num_kv_heads < 256 else 1


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                    num_segments: Optional[int] = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``pagedllm_paged_attention`` semantics (see hookspec) on ``[2, blocks, block_size, Hkv, D]`` caches (fp8
    caches read as ``stored * scale``; ``alibi_slopes`` float32 ``[num_heads]``).

    ``num_segments`` (a power of two) forces the split-K path; default: :func:`default_num_segments`.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert kv_cache.stride(4) == 1, "kv_cache head dimension must be contiguous"
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    group = num_heads // num_kv_heads
    block_m = 16 if group <= 16 else next_pow2(group)
    block_q = block_m // group
    head_pad = max(16, next_pow2(head_size))
    tile = 32 if head_pad <= 128 else 16
    segments = num_segments or default_num_segments(meta, num_kv_heads)
    assert segments & (segments - 1) == 0, "num_segments must be a power of two"
    num_seqs = meta.seq_lens.shape[0]
    if segments > 1:
        part_acc = torch.empty((num_tokens, num_heads, segments, head_pad), dtype=torch.float32, device=query.device)
        part_max = torch.empty((num_tokens, num_heads, segments), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    upcast = interpreting() and query.dtype == torch.bfloat16  # the interpreter's bf16 arithmetic is wrong
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, segments)
    fmt = FORMATS.get(kv_cache.dtype)
    fp8 = dict(KV_FP8=True, MANT=fmt[0], BIAS=fmt[1]) if fmt is not None else {}
    if fmt is not None:
        scale, kv_cache = scale * k_scale, kv_cache.view(torch.uint8)
    _paged_attention_kernel[grid](
        out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        part_acc, part_max, part_sum, alibi_slopes if alibi_slopes is not None else out,
        float(scale), float(soft_cap or 0.0), int(sliding_window or 0), float(v_scale),
        num_seqs, num_heads, group, head_size, kv_cache.shape[2], block_q,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), meta.block_tables.stride(0),
        HEAD_PAD=head_pad, BLOCK_M=block_m, TILE=tile, NUM_SEGMENTS=segments,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None,
        USE_ALIBI=alibi_slopes is not None, UPCAST=upcast, FP32_DOT=upcast or query.dtype == torch.float32, **fp8)
    if segments > 1:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, num_heads, head_size, out.stride(0), out.stride(1),
            HEAD_PAD=head_pad, NUM_SEGMENTS=segments)
    return out
