"""Separate K and V caches per layer: ``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_kv_heads,
head_size]`` — the layout torch-npu's ``_npu_reshape_and_cache``, ``_npu_paged_attention`` and (viewed as
``[num_blocks, block_size, num_kv_heads * head_size]``) ``npu_fused_infer_attention_score`` read, as vllm-ascend
allocates it (vllm-project/vllm-ascend vllm_ascend/worker/model_runner_v1.py: ``kv_caches[layer_name] = (k_cache,
v_cache)``). Block swaps follow vllm-ascend's ``AscendAttentionBackend.swap_blocks``
(vllm_ascend/attention/attention_v1.py, v0.9.1): plain indexed copies on each of the two tensors, in place.
"""

from __future__ import annotations

import torch

from pagedllm.backend.hookspec import KVCacheSpec

KVPair = tuple[torch.Tensor, torch.Tensor]


def cache_shape(spec: KVCacheSpec) -> tuple[int, int, int, int]:
    return (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)


def allocate(spec: KVCacheSpec, pin_memory: bool = False) -> list[KVPair]:
    """One (K, V) pair per layer, zeroed; ``pin_memory`` page-locks each host tensor of each pair."""
    shape = cache_shape(spec)

    def one() -> torch.Tensor:
        if pin_memory:
            return torch.zeros(shape, dtype=spec.dtype, device="cpu", pin_memory=True)
        return torch.zeros(shape, dtype=spec.dtype, device=spec.device)

    return [(one(), one()) for _ in range(spec.num_layers)]


def gather(kv_cache: KVPair, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks in core's canonical layout ``[2, n, block_size, num_kv_heads, head_size]`` (a copy)."""
    k, v = kv_cache
    ids = block_ids.to(device=k.device, dtype=torch.long)
    return torch.stack((k[ids], v[ids]))


def swap_blocks(src_caches: list[KVPair], dst_caches: list[KVPair], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Blocks between device and host caches, either direction, in place on the destination pair."""
    for (sk, sv), (dk, dv) in zip(src_caches, dst_caches):
        s = src.to(device=sk.device, dtype=torch.long)
        d = dst.to(device=dk.device, dtype=torch.long)
        dk[d] = sk[s].to(dk.device)
        dv[d] = sv[s].to(dv.device)
