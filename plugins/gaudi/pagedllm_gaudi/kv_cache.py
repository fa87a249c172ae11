"""KV caches in vllm-gaudi's layout: separate key and value tensors per layer, each
``[num_blocks * block_size, num_kv_heads, head_size]`` (vllm_gaudi/attention/ops/hpu_paged_attn.py
``get_kv_cache_shape``), written with ``index_copy_`` on flat slots (vllm_gaudi/extension/utils.py ``VLLMKVCache``)
and swapped block-wise with ``index_select`` + ``index_copy_`` (vllm_gaudi/extension/cache_ops.py
``swap_blocks``). Not verified on hardware.
"""

from __future__ import annotations

import torch

from pagedllm.backend.hookspec import KVCacheSpec


class HPUKVCache(tuple):
    """``(key_cache, value_cache)`` of one layer; the flat layout does not show the block size, so it rides along."""

    block_size: int

    def __new__(cls, key: torch.Tensor, value: torch.Tensor, block_size: int) -> "HPUKVCache":
        obj = super().__new__(cls, (key, value))
        obj.block_size = block_size
        return obj

    def blocks(self, i: int) -> torch.Tensor:
        """Key (0) or value (1) cache viewed as ``[num_blocks, block_size, num_kv_heads, head_size]``."""
        t = self[i]
        return t.view(-1, self.block_size, *t.shape[1:])


def allocate(spec: KVCacheSpec, device: torch.device, pin_memory: bool = False) -> list[HPUKVCache]:
    """Zero-filled (as vllm-gaudi allocates them): flat_pa reads whole blocks, and padding writes go to the sink."""
    shape = (spec.num_blocks * spec.block_size, spec.num_kv_heads, spec.head_size)

    def one() -> torch.Tensor:
        t = torch.zeros(shape, dtype=spec.dtype, device=device)
        return t.pin_memory() if pin_memory else t

    return [HPUKVCache(one(), one(), spec.block_size) for _ in range(spec.num_layers)]


def _skip_padding(slots: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots and rows for one ``index_copy_`` in which slot -1 writes nothing, without a host sync: a padding token
    re-writes the slot of the nearest real token before it (else the first real one) with that token's own row, so
    the duplicate writes agree; a step with no real token re-writes slot 0 with its current content. Core's static
    path never sends -1 (padding goes to the sink slot, as vllm-gaudi's ``_PAD_SLOT_ID``); dynamic callers may."""
    n = slots.shape[0]
    keep = slots >= 0
    idx = torch.arange(n, device=slots.device)
    last_real = torch.cummax(torch.where(keep, idx, -1), dim=0).values
    first_real = torch.argmax(keep.to(torch.int32))
    src = torch.where(last_real >= 0, last_real, first_real)
    src_real = keep[src]
    out_slots = torch.where(keep, slots, torch.where(src_real, slots[src], 0))
    fallback = cache[0:1].expand(n, *cache.shape[1:])
    out_rows = torch.where(keep[:, None, None], rows,
                           torch.where(src_real[:, None, None], rows[src], fallback))
    return out_slots, out_rows


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: HPUKVCache, slot_mapping: torch.Tensor) -> None:
    """``cache.index_copy_(0, slot_mapping, input)`` per K and V (vllm_gaudi/extension/utils.py
    ``VLLMKVCache.forward``)."""
    k_cache, v_cache = kv_cache
    slots = slot_mapping.to(torch.int64)
    k_slots, k_rows = _skip_padding(slots, key.to(k_cache.dtype), k_cache)
    v_slots, v_rows = _skip_padding(slots, value.to(v_cache.dtype), v_cache)
    k_cache.index_copy_(0, k_slots, k_rows)
    v_cache.index_copy_(0, v_slots, v_rows)


def gather(kv_cache: HPUKVCache, block_ids: torch.Tensor) -> torch.Tensor:
    """Canonical ``[2, n, block_size, num_kv_heads, head_size]``."""
    ids = block_ids.to(device=kv_cache[0].device, dtype=torch.int64)
    return torch.stack([kv_cache.blocks(0).index_select(0, ids), kv_cache.blocks(1).index_select(0, ids)])


def swap_blocks(src_caches: list[HPUKVCache], dst_caches: list[HPUKVCache], src: torch.Tensor,
                dst: torch.Tensor) -> None:
    """``dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))`` per K and V, across devices
    (vllm_gaudi/extension/cache_ops.py ``swap_blocks``)."""
    for s_cache, d_cache in zip(src_caches, dst_caches, strict=True):
        s_ids = src.to(device=s_cache[0].device, dtype=torch.int64)
        d_ids = dst.to(device=d_cache[0].device, dtype=torch.int64)
        for i in (0, 1):
            d_cache.blocks(i).index_copy_(0, d_ids, s_cache.blocks(i).index_select(0, s_ids).to(d_cache[i].device))
