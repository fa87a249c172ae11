"""KV-cache layout and op hooks of the ``ipex`` backend, on ``ipex.llm.modules.PagedAttention``.

Layout (vLLM's IPEX CPU path, vllm/v1/attention/backends/cpu_attn.py ``_IPEXPagedAttention.split_kv_cache``): one
tensor per layer ``[2, num_blocks, num_kv_heads, block_size, head_size]``; ``cache[0]`` is the key cache and
``cache[1]`` the value cache, each ``[num_blocks, num_kv_heads, block_size, head_size]`` as IPEX's kernels read them.
This is not core's canonical layout, so every cache hook (allocate, host allocate, gather, swap) is
implemented here; core's reference never touches it. Not verified on hardware: tested against a simulated IPEX
that implements these calls with core's reference semantics (tests/support/sim/xpu).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.backend.hookspec import KVCacheSpec, hookimpl
from pagedllm_xpu import vendor


def _shape(spec: KVCacheSpec) -> tuple[int, ...]:
    return (2, spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size)


@hookimpl
def pagedllm_allocate_kv_cache(spec: KVCacheSpec) -> list:
    # Uninitialised, like core's CPU backend: untouched pages cost no RAM until a block is used.
    return [torch.empty(_shape(spec), dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)]


@hookimpl
def pagedllm_allocate_host_kv_cache(spec: KVCacheSpec, pin_memory: bool) -> list:
    # The device is the host: swap space is plain host memory in the same layout (pinning buys nothing).
    return [torch.empty(_shape(spec), dtype=spec.dtype, device="cpu") for _ in range(spec.num_layers)]


@hookimpl
def pagedllm_gather_kv_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    return kv_cache[:, block_ids.to(kv_cache.device).long()].transpose(2, 3).contiguous()


@hookimpl
def pagedllm_swap_kv_blocks(src_caches: list, dst_caches: list, src: torch.Tensor, dst: torch.Tensor) -> None:
    for s, d in zip(src_caches, dst_caches):
        d[:, dst.to(d.device).long()] = s[:, src.to(s.device).long()].to(d.device)


@hookimpl
def pagedllm_write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    # IPEX's reshape_and_cache does not document skipping negative slots (vLLM's CUDA kernel does): drop padding
    # tokens first. A host check is free here: the device is the host.
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    # vllm/v1/attention/backends/cpu_attn.py _IPEXPagedAttention.write_to_paged_cache:
    #   ipex_modules.PagedAttention.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.flatten().int())
    vendor.paged_attention_ops().reshape_and_cache(key, value, kv_cache[0], kv_cache[1],
                                                   slot_mapping.flatten().int())


def _head_mapping(num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Query head h -> kv head h // group (vLLM builds it the same way for single_query_cached_kv_attention)."""
    return (torch.arange(num_kv_heads, dtype=torch.int32).view(num_kv_heads, 1)
            .repeat_interleave(num_heads // num_kv_heads).flatten())


@hookimpl
def pagedllm_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: Any, scale: float,
                             sliding_window: Optional[int], soft_cap: Optional[float],
                             alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decodes (the first ``meta.num_decodes`` sequences) through ``single_query_cached_kv_attention``, the prefill
    chunks after them through ``flash_attn_varlen_func`` over the paged cache, both writing into one output.

    Sliding window and soft cap are not declared (vllm/_ipex_ops.py: "IPEX CPU does not support logits_soft_cap",
    and asserts ``window_size_left < 0`` on CPU), so core refuses such models before this is reached.
    """
    if alibi_slopes is not None:
        raise NotImplementedError("this backend does not declare Capabilities.alibi")
    if sliding_window is not None or soft_cap is not None:
        raise NotImplementedError("the ipex backend declares neither sliding_window nor soft_cap")
    ops = vendor.paged_attention_ops()
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_heads, num_kv_heads, block_size = query.shape[1], key_cache.shape[1], key_cache.shape[2]
    out = torch.empty_like(query)
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    d, b = meta.num_decodes, len(seq_lens)
    if d:
        # vllm/v1/attention/backends/cpu_attn.py _IPEXPagedAttention.forward_decode:
        #   single_query_cached_kv_attention(output, query.contiguous(), key_cache, value_cache, head_mapping,
        #       scale, block_tables, context_lens, block_size, max_context_len, alibi_slopes)
        ops.single_query_cached_kv_attention(
            out[:d], query[:d].contiguous(), key_cache, value_cache, _head_mapping(num_heads, num_kv_heads), scale,
            meta.block_tables[:d], meta.seq_lens[:d], block_size, max(seq_lens[:d]), None)
    if d < b:
        start = qsl[d]
        cu_q = (meta.query_start_loc[d:] - start).to(torch.int32)
        cu_k = torch.zeros(b - d + 1, dtype=torch.int32, device=query.device)
        torch.cumsum(meta.seq_lens[d:], dim=0, out=cu_k[1:])
        # vllm/v1/attention/backends/cpu_attn.py (chunked prefill, TorchSDPABackendImpl.forward):
        #   flash_attn_varlen_func(output, query, key_cache, value_cache, prefill_query_start_loc, kv_start_loc,
        #       max_query_len, max_kv_len, scale, True, prefill_block_tables, alibi_slopes)
        # The causal mask is aligned to the end of each sequence: query rows are its last tokens.
        ops.flash_attn_varlen_func(
            out[start:], query[start:].contiguous(), key_cache, value_cache, cu_q, cu_k,
            max(qsl[i + 1] - qsl[i] for i in range(d, b)), max(seq_lens[d:]), scale, True, meta.block_tables[d:],
            None)
    return out


__all__ = ["pagedllm_allocate_kv_cache", "pagedllm_allocate_host_kv_cache", "pagedllm_gather_kv_blocks",
           "pagedllm_swap_kv_blocks", "pagedllm_write_kv", "pagedllm_paged_attention"]
