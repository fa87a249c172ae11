"""Pure-torch reference ops: the semantics of every kernel hook, and the oracle of the conformance suite.

Written for clarity, not speed (per-sequence loops, float32 math). Canonical KV layout per layer:
``[2, num_blocks, block_size, num_kv_heads, head_size]``; MLA's ``[1, num_blocks, block_size, 1, latent]``. Either in
the model dtype or fp8 (``pagedllm.backend.kv_quant``: writes store ``saturate(x * (1 / k_scale))``, reads give
``stored * k_scale``; the same for values with ``v_scale``).
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.kv_quant import dequantize_kv, quantize_kv


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype, device: torch.device | str, mla: bool = False) -> list[torch.Tensor]:
    shape = (1 if mla else 2, num_blocks, block_size, num_kv_heads, head_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter ``[T, Hkv, D]`` keys/values into flat slots; slots < 0 are skipped. An fp8 cache stores
    ``saturate(key * (1 / k_scale))`` and ``saturate(value * (1 / v_scale))``."""
    _, nb, bs, h, d = kv_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_cache[0].view(nb * bs, h, d)[slots] = quantize_kv(key[keep], k_scale, kv_cache.dtype)
    kv_cache[1].view(nb * bs, h, d)[slots] = quantize_kv(value[keep], v_scale, kv_cache.dtype)


def gather_kv_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    return kv_cache[:, block_ids.long()]


def swap_kv_blocks(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], src: torch.Tensor,
                   dst: torch.Tensor) -> None:
    for s, d in zip(src_caches, dst_caches):
        d[:, dst.long().to(d.device)] = s[:, src.long().to(s.device)].to(d.device)


def _sequences(meta: AttentionMetadata, block_size: int, device: torch.device) -> Iterator[tuple]:
    """Each sequence with queries this step: its query rows ``start:end``, its block ids, and the query and key
    positions as ``[L, 1]`` / ``[1, S]`` (a chunk's queries are the sequence's last tokens)."""
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        blocks = meta.block_tables[i, :(seq_len + block_size - 1) // block_size].long()
        yield (start, end, blocks, torch.arange(seq_len - (end - start), seq_len, device=device)[:, None],
               torch.arange(seq_len, device=device)[None, :])


def _rows(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` token rows held by ``blocks`` of one cache half ``[num_blocks, block_size, ...]``."""
    return cache[blocks].flatten(0, 1)[:seq_len]


def same_span(q_pos: torch.Tensor, k_pos: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """bool ``[L, S]``: query and key positions (``[L, 1]`` / ``[1, S]``) inside one of ``ranges`` (``[start, end)``
    position spans, ``AttentionMetadata.mm_prefix_ranges`` of one sequence): the pairs a PrefixLM image span makes
    visible in both directions (HF's ``blockwise_overlay``)."""
    out = torch.zeros(q_pos.shape[0], k_pos.shape[1], dtype=torch.bool, device=q_pos.device)
    for lo, hi in ranges:
        out |= ((q_pos >= lo) & (q_pos < hi)) & ((k_pos >= lo) & (k_pos < hi))
    return out


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: Optional[int] = None, soft_cap: Optional[float] = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, alibi_slopes: Optional[torch.Tensor] = None,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """See ``hookspec.pagedllm_paged_attention``. One sequence at a time, scores in float32; an fp8 cache is read as
    ``stored * k_scale`` / ``stored * v_scale``. ``sinks``: transformers' GPT-OSS ``eager_attention_forward``
    (the sink logit concatenated as one more column, softmax, the column dropped). ``meta.mm_prefix_ranges``: keys in
    the query's image span are visible before the window applies (HF Gemma 3: ``AND(window, OR(causal, span))``)."""
    group = query.shape[1] // kv_cache.shape[3]
    out = torch.empty_like(query)
    spans = ({meta.query_start_loc_cpu[i]: r for i, r in enumerate(meta.mm_prefix_ranges) if r}
             if meta.mm_prefix_ranges else {})
    for start, end, blocks, q_pos, k_pos in _sequences(meta, kv_cache.shape[2], query.device):
        k = dequantize_kv(_rows(kv_cache[0], blocks, k_pos.shape[1]), k_scale, torch.float32)
        v = dequantize_kv(_rows(kv_cache[1], blocks, k_pos.shape[1]), v_scale, torch.float32)
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [L, H, D]
        scores = torch.einsum("lhd,shd->hls", q, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.float().view(-1, 1, 1) * (k_pos - q_pos)[None]
        allowed = k_pos <= q_pos
        if start in spans:
            allowed = allowed | same_span(q_pos, k_pos, spans[start])
        if sliding_window is not None:
            allowed &= (q_pos - k_pos) < sliding_window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        if sliding_window is not None:  # keys no query reads (a freed window block: sched/kv_groups.py) may hold
            v = v.masked_fill(~allowed.any(0)[:, None, None], 0.0)  # anything, NaN too: 0 * NaN would be NaN
        if sinks is not None:
            sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hls,shd->lhd", probs, v).to(query.dtype)
    return out


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int, scale: float, causal: bool = False) -> torch.Tensor:
    """See ``hookspec.pagedllm_encoder_attention``: varlen attention over unpaged q/k/v, one sequence at a time,
    scores in float32. Rows past ``cu_seqlens[-1]`` (padding) come out zero."""
    group = query.shape[1] // key.shape[1]
    out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        q = query[start:end].float()  # [L, H, D]
        k = key[start:end].float().repeat_interleave(group, dim=1)
        v = value[start:end].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", q, k) * scale
        if causal:
            pos = torch.arange(end - start, device=query.device)
            scores = scores.masked_fill((pos[None, :] > pos[:, None])[None], float("-inf"))
        out[start:end] = torch.einsum("hls,shd->lhd", torch.softmax(scores, dim=-1), v).to(out.dtype)
    return out


def write_mla_kv(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """See ``hookspec.pagedllm_write_mla_kv``: scatter ``[T, latent]`` rows into flat slots; slots < 0 skipped."""
    _, nb, bs, _, d = kv_cache.shape
    keep = slot_mapping >= 0
    kv_cache.view(nb * bs, d)[slot_mapping[keep]] = latent[keep].to(kv_cache.dtype)


def mla_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                  value_size: int) -> torch.Tensor:
    """See ``hookspec.pagedllm_mla_attention``. One sequence at a time, scores in float32; every head reads the
    same latent rows (MQA over the latent)."""
    out = query.new_empty(query.shape[0], query.shape[1], value_size)
    for start, end, blocks, q_pos, k_pos in _sequences(meta, kv_cache.shape[2], query.device):
        rows = _rows(kv_cache[0], blocks, k_pos.shape[1]).flatten(1).float()  # [S, D]
        scores = torch.einsum("lhd,sd->hls", query[start:end].float(), rows) * scale
        scores = scores.masked_fill(~(k_pos <= q_pos)[None], float("-inf"))
        out[start:end] = torch.einsum("hls,sd->lhd", torch.softmax(scores, dim=-1), rows[:, :value_size]).to(out.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalize in float32, cast back, then scale."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, rounded to x's dtype and written into ``x``, then ``rms_norm`` of the sum; returns
    (normed, sum)."""
    x.add_(residual)
    return rms_norm(x, weight, eps), x


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox/HF rotary over the first ``rot_dim`` features; ``cos_sin_cache[p] = cat(cos, sin)`` of width rot_dim."""
    cs = cos_sin_cache[positions.long()]  # [T, rot_dim]
    half = cs.shape[-1] // 2
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1)[:, None, :]
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1)[:, None, :]
    rot = cs.shape[-1]

    def apply(x: torch.Tensor) -> torch.Tensor:
        xr, xp = x[..., :rot], x[..., rot:]
        y = (xr * cos.to(x.dtype)) + (rotate_half(xr) * sin.to(x.dtype))
        return torch.cat((y, xp), dim=-1) if xp.numel() else y

    return apply(query), apply(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """See ``hookspec.pagedllm_apply_token_bitmask``: unpack the int32 words to a bool mask, fill -inf."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits.masked_fill_(~allowed, float("-inf"))


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """See ``hookspec.pagedllm_fused_moe``. One expert at a time over the tokens routed to it, as HF's experts do."""
    out = torch.zeros_like(hidden_states)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        gu = F.linear(hidden_states[token], w13[e])
        y = F.linear(silu_and_mul(gu), w2[e]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
