"""``PagedAttention`` with the call signatures vLLM uses (vllm/v1/attention/backends/cpu_attn.py
``_IPEXPagedAttention``; IPEX's ``_IPEXPagedAttentionCPU``), computed by ``pagedllm.backend.ref_ops`` on a canonical copy of
the IPEX cache ``[num_blocks, num_kv_heads, block_size, head_size]``. Arguments are checked the way the real
kernels' schemas constrain them, so a wrong call fails here."""

from __future__ import annotations

import torch

from pagedllm.backend import ref_ops
from pagedllm.backend.attention import AttentionMetadata

CALLS: list = []


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"caches must be [num_blocks, num_kv_heads, block_size, head_size], got "
                         f"{tuple(key_cache.shape)} / {tuple(value_cache.shape)}")


def _canonical(key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
    return torch.stack([key_cache.transpose(1, 2), value_cache.transpose(1, 2)])  # [2, nb, bs, hkv, d] copy


def _attend(output, query, key_cache, value_cache, query_lens, seq_lens, block_tables, scale):
    bs = key_cache.shape[2]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables, slot_mapping=torch.empty(0, dtype=torch.int64), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), num_decodes=0, block_size=bs, query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens))
    output.copy_(ref_ops.paged_attention(query, _canonical(key_cache, value_cache), meta, scale))


class PagedAttention:
    @classmethod
    def reshape_and_cache(cls, key, value, key_cache, value_cache, slot_mapping):
        CALLS.append("reshape_and_cache")
        _check_caches(key_cache, value_cache)
        if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.dim() != 1:
            raise TypeError(f"slot_mapping must be a 1-D integer tensor, got {slot_mapping.dtype} "
                            f"{tuple(slot_mapping.shape)}")
        if key.dim() != 3 or key.shape[1:] != (key_cache.shape[1], key_cache.shape[3]):
            raise ValueError(f"key must be [num_tokens, num_kv_heads, head_size], got {tuple(key.shape)}")
        canon = _canonical(key_cache, value_cache)
        ref_ops.write_kv(key, value, canon, slot_mapping.long())
        key_cache.copy_(canon[0].transpose(1, 2))
        value_cache.copy_(canon[1].transpose(1, 2))

    @classmethod
    def single_query_cached_kv_attention(cls, output, query, key_cache, value_cache, head_mapping, scale,
                                         block_tables, context_lens, block_size, max_context_len, alibi_slopes):
        CALLS.append("single_query_cached_kv_attention")
        _check_caches(key_cache, value_cache)
        num_heads, num_kv_heads = query.shape[1], key_cache.shape[1]
        want = torch.arange(num_heads, dtype=torch.int32) // (num_heads // num_kv_heads)
        if head_mapping.dtype != torch.int32 or not torch.equal(head_mapping.cpu(), want):
            raise ValueError(f"head_mapping must map query head h to kv head h // group (int32): {head_mapping}")
        if block_size != key_cache.shape[2] or alibi_slopes is not None or not query.is_contiguous():
            raise ValueError("block_size must match the cache, alibi_slopes None, query contiguous")
        lens = [int(x) for x in context_lens]
        if max_context_len < max(lens):
            raise ValueError(f"max_context_len {max_context_len} < longest context {max(lens)}")
        if output.shape != query.shape:
            raise ValueError(f"output {tuple(output.shape)} != query {tuple(query.shape)}")
        _attend(output, query, key_cache, value_cache, [1] * len(lens), lens, block_tables, scale)

    @classmethod
    def flash_attn_varlen_func(cls, output, query, key_cache, value_cache, cu_seqlens_q, cu_seqlens_kv,
                               max_seqlen_q, max_seqlen_kv, scale, is_causal, block_table, alibi_slopes=None,
                               **kwargs):
        CALLS.append("flash_attn_varlen_func")
        _check_caches(key_cache, value_cache)
        if not is_causal or alibi_slopes is not None or kwargs:
            raise ValueError(f"only causal attention without alibi/extras is simulated: {kwargs}")
        if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_kv.dtype != torch.int32:
            raise TypeError("cu_seqlens_q / cu_seqlens_kv must be int32")
        cq, ck = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_kv]
        qlens = [b - a for a, b in zip(cq, cq[1:])]
        klens = [b - a for a, b in zip(ck, ck[1:])]
        if cq[0] != 0 or ck[0] != 0 or cq[-1] != query.shape[0] or output.shape != query.shape:
            raise ValueError(f"cu_seqlens_q {cq} must start at 0 and cover the {query.shape[0]} query rows")
        if max_seqlen_q < max(qlens) or max_seqlen_kv < max(klens) or block_table.shape[0] != len(qlens):
            raise ValueError("max_seqlen_q/kv below the longest sequence, or block_table rows != sequences")
        if any(q > k for q, k in zip(qlens, klens)):
            raise ValueError(f"query longer than its key sequence: {qlens} vs {klens}")
        _attend(output, query, key_cache, value_cache, qlens, klens, block_table, scale)
