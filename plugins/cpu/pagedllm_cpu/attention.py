"""Paged attention and KV writes on the canonical layout ``[2, num_blocks, block_size, num_kv_heads, head_size]``.

Decodes are batched (no per-token Python): their blocks are gathered through the block tables into a padded
``[B, S, Hkv, D]`` buffer and attended by torch's fused CPU SDPA with GQA, a few sequences at a time so the keys are
still in cache; sequences of very different lengths go in separate groups so nobody pads to the longest. Prefill
chunks run one sequence at a time through the same fused SDPA (causal, or an explicit mask over cached context).
Everything that depends only on the batch (gather indices, masks) is computed once per step and cached in
``meta.extra``, since the model calls attention once per layer with the same metadata. Soft-capping is not in SDPA:
it takes a float32 matmul path. An fp8 cache (``kv_cache_dtype=fp8``) is gathered as fp8 (a quarter of the fp32 bytes),
converted to the query's dtype in the reused buffer, and its scales are folded into the softmax scale (keys) and the
output (values), so the attention itself is unchanged. ALiBi is an additive per-head float mask
``slope_h * (k_pos - q_pos)`` on top of the causal one, built from the plan's relative positions (``rel``).
PrefixLM image spans (``meta.mm_prefix_ranges``, Gemma 3 with vision) widen a prefill chunk's explicit mask: the
tokens of one image see each other, then the window applies; decodes never fall in a span.

When the C++ kernel (``native.py``) is built, decodes skip the gather altogether: it reads keys and values in
place through the block table. The gather + SDPA path above stays for fp8 caches and until (or unless) it is built.

Attention sinks (GPT-OSS: a per-head logit that joins every softmax, ``sinks`` of the hook): the C++ decode kernel
adds the sink to its online softmax's denominator. SDPA has no such input, but its CPU flash kernel returns the
log-sum-exp of each row, and a sink only grows the denominator: ``out_sink = out * sigmoid(lse - sink)``, so prefill
chunks run the fused kernel (keys expanded to every query head: it takes no GQA) and rescale. Decodes while the
kernel is not built, and sinks with soft-capping, take the float32 matmul path of soft-capping with the sink in the
softmax's denominator (``_softmax_with_sinks``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.kv_quant import is_fp8, quantize_kv
from pagedllm.backend.ref_ops import same_span
from pagedllm_cpu import native
from pagedllm_cpu.ops import direct

_PLAN_KEY = "pagedllm_cpu.plan"
_SPLIT_MIN_BLOCKS = 8  # decode batches whose longest context fits in this many blocks stay one group
_CHUNK_BYTES = 8 << 20  # gathered K+V per decode chunk: stays in cache between the gather and the attention
_SCORES_BUDGET = 1 << 25  # float32 scores per soft-capped prefill pass (128 MiB)
_local = threading.local()
#: torch's fused CPU attention that also returns each row's log-sum-exp (what SDPA calls on CPU); None if absent.
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat scratch buffer reused across layers and steps: a fresh multi-MB tensor per call costs more in page
    faults than the gather itself. Per thread, so concurrent engines never share one; per inference-mode state,
    since a buffer made under inference_mode cannot be written outside it."""
    pool = _local.__dict__.setdefault("pool", {})
    key = (dtype, device, torch.is_inference_mode_enabled())
    buf = pool.get(key)
    if buf is None or buf.numel() < numel:
        buf = pool[key] = torch.empty(numel + numel // 4, dtype=dtype, device=device)
    return buf[:numel]


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter ``[T, Hkv, D]`` keys/values into flat slots, slots < 0 skipped: one C++ call (``csrc/write_kv.cpp``)
    when the cache has their dtype, else ``index_copy_``. fp8 caches store ``saturate(x * (1 / scale))``
    (``pagedllm.backend.kv_quant.quantize_kv``), copied as bytes (torch has no fp8 ``index_copy_`` on CPU)."""
    lib = native.lib
    if (lib is not None and key.dtype == kv_cache.dtype and value.dtype == kv_cache.dtype and kv_cache.is_contiguous()
            and key.stride(-1) == 1 and value.stride(-1) == 1):
        direct.write_kv(kv_cache, key, value, slot_mapping)
        return
    _, nb, bs, h, d = kv_cache.shape
    slots = slot_mapping
    if slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    slots = slots.long()
    if is_fp8(kv_cache.dtype):
        raw = kv_cache.view(torch.uint8)
        raw[0].view(nb * bs, h, d).index_copy_(0, slots, quantize_kv(key, k_scale, kv_cache.dtype).view(torch.uint8))
        raw[1].view(nb * bs, h, d).index_copy_(0, slots, quantize_kv(value, v_scale, kv_cache.dtype).view(torch.uint8))
        return
    kv_cache[0].view(nb * bs, h, d).index_copy_(0, slots, key.to(kv_cache.dtype))
    kv_cache[1].view(nb * bs, h, d).index_copy_(0, slots, value.to(kv_cache.dtype))


@dataclass
class _DecodeGroup:
    """Decodes batched into one op: ``nblk`` blocks gathered per sequence (from the first block its window needs)
    into ``S = nblk * bs`` key rows; ``valid[b, s]`` says whether row s is a real key of sequence b in its window."""

    rows: Optional[torch.Tensor]  # long [B]: the group's query rows; None = all decodes, in order
    block_ids: torch.Tensor  # long [B * nblk]
    valid: torch.Tensor  # bool [B, S]
    nblk: int
    rel: torch.Tensor  # float32 [B, S]: key position minus the query's (ALiBi)
    biases: dict = field(default_factory=dict)  # dtype -> additive mask [B, 1, 1, S] (0 / -inf)
    _chunks: dict = field(default_factory=dict)

    def chunks(self, size: int) -> list[tuple[int, int, Optional[torch.Tensor]]]:
        """(first, end, invalid rows of the chunk's flat [n * S] keys or None) per chunk of ``size`` sequences."""
        got = self._chunks.get(size)
        if got is None:
            got = self._chunks[size] = []
            for s0 in range(0, self.valid.shape[0], size):
                s1 = min(s0 + size, self.valid.shape[0])
                inv = (~self.valid[s0:s1]).view(-1).nonzero().squeeze(1)
                got.append((s0, s1, inv if inv.numel() else None))
        return got

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """SDPA takes an additive mask in the query's dtype faster than a bool one it must convert every call."""
        b = self.biases.get(dtype)
        if b is None:
            v = self.valid.view(self.valid.shape[0], 1, 1, -1)
            b = self.biases[dtype] = torch.zeros(v.shape, dtype=dtype, device=v.device).masked_fill_(~v, float("-inf"))
        return b

    def alibi_bias(self, dtype: torch.dtype, slopes: torch.Tensor) -> torch.Tensor:
        """``[B, H, 1, S]``: the causal mask plus each head's ALiBi bias."""
        b = self.rel.view(self.rel.shape[0], 1, 1, -1) * slopes.float().view(1, -1, 1, 1)
        return b.masked_fill_(~self.valid.view(b.shape[0], 1, 1, -1), float("-inf")).to(dtype)


@dataclass
class _PrefillSeq:
    """One prefill chunk: query rows [start, end), keys at positions [k_lo, seq_len) read from ``block_ids``."""

    start: int
    end: int
    block_ids: torch.Tensor  # long [nblk]
    skip: int  # rows of the first gathered block before k_lo
    num_keys: int  # seq_len - k_lo
    mask: Optional[torch.Tensor]  # bool [L, num_keys], None when plain causal with no cached context
    q_lo: int = 0  # position of the first query token
    k_lo: int = 0  # position of the first key
    biases: dict = field(default_factory=dict)  # dtype -> additive mask [1, 1, L, num_keys] (0 / -inf)

    def bias(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The mask as SDPA takes it fastest (a bool mask is converted on every call, every layer)."""
        if self.mask is None:
            return None
        b = self.biases.get(dtype)
        if b is None:
            b = self.biases[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))[None, None]
        return b

    def alibi_bias(self, dtype: torch.dtype, slopes: torch.Tensor) -> torch.Tensor:
        """``[1, H, L, num_keys]``: the causal (and window) mask plus each head's ALiBi bias."""
        q_pos = torch.arange(self.q_lo, self.q_lo + self.end - self.start, device=slopes.device)[:, None]
        k_pos = torch.arange(self.k_lo, self.k_lo + self.num_keys, device=slopes.device)[None, :]
        mask = self.mask if self.mask is not None else k_pos <= q_pos
        b = slopes.float().view(-1, 1, 1) * (k_pos - q_pos).float()[None]
        return b.masked_fill_(~mask[None], float("-inf")).to(dtype)[None]


@dataclass
class _Plan:
    decodes: list[_DecodeGroup]
    prefills: list[_PrefillSeq]


def _split_by_length(nblk: list[int]) -> list[list[int]]:
    """Group decode indices so no sequence is padded to more than twice its own block count: one long context
    must not make the whole batch attend over its length. Usually one group (similar lengths), in order.
    Short contexts (all within _SPLIT_MIN_BLOCKS) are never split: there the padding costs less than another call."""
    if max(nblk) < 2 * min(nblk) or max(nblk) <= _SPLIT_MIN_BLOCKS:
        return [list(range(len(nblk)))]
    groups: list[list[int]] = []
    for i in sorted(range(len(nblk)), key=lambda j: -nblk[j]):
        if not groups or 2 * nblk[i] <= nblk[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    return groups


def _decode_group(meta: AttentionMetadata, rows: Optional[list[int]], seq_lens: torch.Tensor, first: torch.Tensor,
                  num_blocks: int) -> _DecodeGroup:
    bs = meta.block_size
    bt = meta.block_tables[: meta.num_decodes].long()
    idx = None
    if rows is not None:
        idx = torch.tensor(rows, dtype=torch.long, device=bt.device)
        seq_lens, first, bt = seq_lens[idx], first[idx], bt[idx]
    first_blk = first // bs
    nblk = int(((seq_lens - 1) // bs - first_blk).max()) + 1
    cols = (first_blk[:, None] + torch.arange(nblk, device=bt.device)[None, :]).clamp_(max=bt.shape[1] - 1)
    block_ids = bt.gather(1, cols).clamp_(0, num_blocks - 1).reshape(-1)
    pos = first_blk[:, None] * bs + torch.arange(nblk * bs, device=bt.device)[None, :]
    valid = (pos < seq_lens[:, None]) & (pos >= first[:, None])
    return _DecodeGroup(idx, block_ids, valid, nblk, (pos - (seq_lens[:, None] - 1)).float())


def _plan_decodes(meta: AttentionMetadata, window: Optional[int], num_blocks: int) -> list[_DecodeGroup]:
    b = meta.num_decodes
    if b == 0:
        return []
    bs = meta.block_size
    seq_lens = meta.seq_lens[:b].long()
    first = (seq_lens - window).clamp_(min=0) if window is not None else torch.zeros_like(seq_lens)
    nblk = ((seq_lens - 1) // bs - first // bs + 1).tolist()
    groups = _split_by_length(nblk)
    if len(groups) == 1:
        return [_decode_group(meta, None, seq_lens, first, num_blocks)]
    return [_decode_group(meta, g, seq_lens, first, num_blocks) for g in groups]


def _plan_prefills(meta: AttentionMetadata, window: Optional[int]) -> list[_PrefillSeq]:
    bs = meta.block_size
    qsl = meta.query_start_loc_cpu
    out = []
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end, seq_len = qsl[i], qsl[i + 1], meta.seq_lens_cpu[i]
        qlen = end - start
        if qlen == 0:
            continue
        q_lo = seq_len - qlen  # position of the chunk's first query token
        k_lo = max(0, q_lo - window + 1) if window is not None else 0
        b0, b1 = k_lo // bs, (seq_len + bs - 1) // bs
        block_ids = meta.block_tables[i, b0:b1].long()
        mask = None
        spans = meta.mm_prefix_ranges[i] if meta.mm_prefix_ranges and i < len(meta.mm_prefix_ranges) else None
        if q_lo > 0 or (window is not None and window < qlen) or spans:
            q_pos = torch.arange(q_lo, seq_len)[:, None]
            k_pos = torch.arange(k_lo, seq_len)[None, :]
            mask = k_pos <= q_pos
            if spans:  # PrefixLM image spans: their tokens see each other (then the window applies)
                mask |= same_span(q_pos, k_pos, spans)
            if window is not None:
                mask &= (q_pos - k_pos) < window
            mask = mask.to(block_ids.device)
        out.append(_PrefillSeq(start, end, block_ids, k_lo - b0 * bs, seq_len - k_lo, mask, q_lo, k_lo))
    return out


def _get_plan(meta: AttentionMetadata, window: Optional[int], num_blocks: int, decodes: bool = True) -> _Plan:
    """The step's plan for one window; ``decodes=False`` when the kernel attends them (nothing to gather)."""
    plans = meta.extra.setdefault(_PLAN_KEY, {})
    plan = plans.get((window, decodes))
    if plan is None:
        plan = plans[(window, decodes)] = _Plan(_plan_decodes(meta, window, num_blocks) if decodes else [],
                                                _plan_prefills(meta, window))
    return plan


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of float32 ``scores`` with one more virtual column per head holding ``sinks``
    (broadcast to ``[..., 1]``), that column dropped: transformers' GPT-OSS eager attention, without the concat."""
    m = torch.maximum(scores.amax(-1, keepdim=True), sinks)
    e = scores.sub_(m).exp_()
    return e.div_(e.sum(-1, keepdim=True).add_((sinks - m).exp_()))


def _decode_kernel(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata):
    """The in-place decode kernel when it is built and takes this call (same dtype for query and cache, not fp8)."""
    if meta.num_decodes == 0 or is_fp8(kv_cache.dtype) or kv_cache.dtype != query.dtype:
        return None
    return native.get()


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``block_ids`` of keys and values as ``[2, n, block_size * Hkv * D]`` in a reused buffer of ``dtype``
    (index_select on the leading dim: copy bandwidth); an fp8 cache is gathered as fp8, then converted."""
    nb = kv_cache.shape[1]
    row = kv_cache[0, 0].numel()
    kv = _workspace(2 * n * row, kv_cache.dtype, kv_cache.device).view(2, n, row)
    for i in range(2):
        torch.index_select(kv_cache[i].view(nb, row), 0, block_ids, out=kv[i])
    if kv_cache.dtype == dtype:
        return kv
    return _workspace(2 * n * row, dtype, kv_cache.device).view(2, n, row).copy_(kv)


def _decode(query: torch.Tensor, kv_cache: torch.Tensor, group: _DecodeGroup, scale: float,
            soft_cap: Optional[float], out: torch.Tensor, alibi_slopes: Optional[torch.Tensor] = None,
            sinks: Optional[torch.Tensor] = None) -> None:
    """Attention for one decode group: its query rows ``[B, H, D]`` -> ``out`` ``[B, H, D]``.

    Sequences go in chunks of about ``_CHUNK_BYTES`` of gathered K/V, so the attention reads its keys from cache
    rather than DRAM: the same speed at short contexts, 15-35% faster at contexts of 500-2000 than one gather."""
    _, nb, bs, hkv, d = kv_cache.shape
    h = query.shape[1]
    s = group.nblk * bs
    dtype = query.dtype if is_fp8(kv_cache.dtype) else kv_cache.dtype
    per_seq = 2 * s * hkv * d * dtype.itemsize
    exact = soft_cap is None and sinks is None  # SDPA; else the float32 path
    bias_dtype = query.dtype if exact else torch.float32
    bias = group.bias(bias_dtype) if alibi_slopes is None else group.alibi_bias(bias_dtype, alibi_slopes)
    for s0, s1, invalid_rows in group.chunks(max(1, _CHUNK_BYTES // per_seq)):
        n = s1 - s0
        kv = _gather(kv_cache, group.block_ids[s0 * group.nblk:s1 * group.nblk], n * group.nblk, dtype)
        for i in range(2):
            if invalid_rows is not None:  # unwritten/out-of-window slots may hold anything, even NaN: 0*NaN=NaN
                kv[i].view(n * s, hkv * d).index_fill_(0, invalid_rows, 0)
        kv = kv.view(2, n, s, hkv, d)
        k, v = kv[0], kv[1]
        if exact:
            q = query[s0:s1].reshape(n, h, 1, d)
            out[s0:s1] = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias[s0:s1],
                                                        scale=scale, enable_gqa=True).view(n, h, d)
            continue
        g = h // hkv
        q = query[s0:s1].reshape(n, hkv, g, d).float()
        scores = torch.einsum("bkgd,bskd->bkgs", q, k.float())
        if soft_cap is not None:
            scores.mul_(scale / soft_cap).tanh_().mul_(soft_cap)
        else:
            scores.mul_(scale)
        scores.add_(bias[s0:s1].view(n, hkv, -1, s) if alibi_slopes is not None else bias[s0:s1])
        probs = (torch.softmax(scores, dim=-1) if sinks is None
                 else _softmax_with_sinks(scores, sinks.float().view(1, hkv, g, 1)))
        out[s0:s1] = torch.einsum("bkgs,bskd->bkgd", probs, v.float()).reshape(n, h, d)


def _prefill(query: torch.Tensor, kv_cache: torch.Tensor, p: _PrefillSeq, scale: float,
             soft_cap: Optional[float], alibi_slopes: Optional[torch.Tensor] = None,
             sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    _, nb, bs, hkv, d = kv_cache.shape
    h = query.shape[1]
    n = p.block_ids.numel()
    kv = _gather(kv_cache, p.block_ids, n, query.dtype if is_fp8(kv_cache.dtype) else kv_cache.dtype)
    kv = kv.view(2, n * bs, hkv, d)[:, p.skip:p.skip + p.num_keys]
    k, v = kv[0], kv[1]
    q = query[p.start:p.end]  # [L, H, D]
    if alibi_slopes is not None and (soft_cap is not None or sinks is not None):
        raise NotImplementedError("ALiBi together with soft-capping or sinks is not implemented (no model uses both)")
    if sinks is not None and soft_cap is None and _FLASH_LSE is not None:
        return _prefill_sinks(q, k, v, p, scale, sinks)
    if soft_cap is None and sinks is None:  # 4-D: torch's fused CPU kernel takes only 4-D inputs (3-D: slow path)
        bias = p.bias(q.dtype) if alibi_slopes is None else p.alibi_bias(q.dtype, alibi_slopes)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=bias, is_causal=bias is None, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)
    g = h // hkv
    qlen = q.shape[0]
    mask = p.mask if p.mask is not None else torch.ones(qlen, p.num_keys, dtype=torch.bool).tril_()
    kf, vf = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [Hkv, S, D]
    out = torch.empty(qlen, h, d, dtype=query.dtype, device=query.device)
    step = max(1, _SCORES_BUDGET // (h * p.num_keys))  # query rows per pass: bounds the float32 score matrix
    for r in range(0, qlen, step):
        n = min(step, qlen - r)
        qg = q[r:r + n].float().view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
        scores = torch.bmm(qg, kf.transpose(1, 2))
        if soft_cap is not None:
            scores.mul_(scale / soft_cap).tanh_().mul_(soft_cap)
        else:
            scores.mul_(scale)
        scores = scores.view(hkv, g, n, -1).masked_fill_(~mask[r:r + n], float("-inf"))
        probs = (torch.softmax(scores, dim=-1) if sinks is None
                 else _softmax_with_sinks(scores, sinks.float().view(hkv, g, 1, 1))).view(hkv, g * n, -1)
        out[r:r + n] = torch.bmm(probs, vf).view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, h, d)
    return out


def _prefill_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: _PrefillSeq, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """One chunk with sinks on torch's fused kernel: ``out * sigmoid(lse - sink)`` per head and query row (the sink's
    ``exp`` joins the denominator ``exp(lse)``). ``q`` ``[L, H, D]``, ``k``/``v`` ``[S, Hkv, D]`` -> ``[L, H, D]``."""
    g = q.shape[1] // k.shape[1]
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, S, D]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
    bias = p.bias(q.dtype)
    out, lse = _FLASH_LSE(q.transpose(0, 1)[None], k[None], v[None], 0.0, bias is None, attn_mask=bias, scale=scale)
    keep = torch.sigmoid(lse[0].float() - sinks.float()[:, None])  # [H, L]
    return (out[0].float() * keep[..., None]).to(q.dtype).transpose(0, 1)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: Optional[int] = None, soft_cap: Optional[float] = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, alibi_slopes: Optional[torch.Tensor] = None,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same semantics as ``pagedllm.backend.ref_ops.paged_attention`` (see the hookspec); returns ``[T, H, D]``."""
    out = _attention(query, kv_cache, meta, scale * k_scale if is_fp8(kv_cache.dtype) else scale, sliding_window,
                     soft_cap, alibi_slopes, sinks)
    if is_fp8(kv_cache.dtype) and v_scale != 1.0:  # softmax(.) @ (v * s) = s * (softmax(.) @ v)
        out.mul_(v_scale)
    return out


def _attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: Optional[int], soft_cap: Optional[float],
               alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    kernel = _decode_kernel(query, kv_cache, meta)
    out = torch.empty_like(query)
    if kernel is not None and meta.num_decodes == query.shape[0]:  # a pure decode step: one call, no plan or slices
        kernel(out, query, kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window or 0, soft_cap or 0.0,
               alibi_slopes, sinks)
        return out
    plan = _get_plan(meta, sliding_window, kv_cache.shape[1], decodes=kernel is None)
    if kernel is not None:
        nd = meta.num_decodes
        kernel(out[:nd], query[:nd], kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window or 0,
               soft_cap or 0.0, alibi_slopes, sinks)
    for group in plan.decodes:
        if group.rows is None:
            _decode(query[: meta.num_decodes], kv_cache, group, scale, soft_cap, out[: meta.num_decodes], alibi_slopes,
                    sinks)
        else:
            res = torch.empty((group.rows.numel(),) + query.shape[1:], dtype=query.dtype, device=query.device)
            _decode(query.index_select(0, group.rows), kv_cache, group, scale, soft_cap, res, alibi_slopes, sinks)
            out.index_copy_(0, group.rows, res)
    for p in plan.prefills:
        out[p.start:p.end] = _prefill(query, kv_cache, p, scale, soft_cap, alibi_slopes, sinks)
    return out
