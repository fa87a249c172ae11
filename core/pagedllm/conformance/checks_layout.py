"""Layout ownership: core's reference ops assume the canonical layout, so a backend whose ``allocate_kv_cache``
returns anything else must implement every hook that reads or writes a cache itself. ``Backend`` binds each hook to
exactly one implementation (``Backend.implements`` says whether it is the backend's own); a hook left to the reference
on a backend's own layout would crash on a tuple or silently corrupt a ``[num_blocks, 2, ...]`` tensor. Host caches
are the exception: without ``pagedllm_allocate_host_kv_cache`` core asks the backend's own allocator for host memory
(contract v1 had no host allocator), or refuses swap and preempts by recompute."""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedllm.backend.registry import SwapUnsupported
from pagedllm.conformance.harness import CaseContext, CheckFailed
from pagedllm.backend.hookspec import KVCacheSpec

#: Hooks that touch a KV cache object, so must match the allocator's layout.
CACHE_HOOKS = ("pagedllm_allocate_host_kv_cache", "pagedllm_write_kv", "pagedllm_paged_attention",
               "pagedllm_gather_kv_blocks", "pagedllm_swap_kv_blocks")


def layout_of(cache: object) -> str:
    if isinstance(cache, torch.Tensor):
        return f"tensor {tuple(cache.shape)} (stride {cache.stride()})"
    if isinstance(cache, (list, tuple)):
        return f"{type(cache).__name__} of {len(cache)}: [" + ", ".join(layout_of(c) for c in cache) + "]"
    return type(cache).__name__


def is_canonical(cache: object, spec: KVCacheSpec) -> bool:
    """One contiguous tensor ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (what ``ref_ops`` index)."""
    want = (2, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    return isinstance(cache, torch.Tensor) and tuple(cache.shape) == want and cache.is_contiguous()


def check_layout_ownership(ctx: CaseContext) -> None:
    hs, bs = ctx.params["head_size"], ctx.params["block_size"]
    spec = KVCacheSpec(1, 7, bs, 2, hs, ctx.dtype, ctx.device)  # 7 blocks: no axis size coincides with another
    (cache,) = ctx.backend.allocate_kv_cache(spec)
    if is_canonical(cache, spec):
        ctx.notes.append("canonical layout: reference ops may serve any cache hook")
        return
    if not ctx.backend.implements("pagedllm_allocate_kv_cache"):
        raise CheckFailed("core's reference allocator returned a non-canonical cache: " + layout_of(cache))
    borrowed = [h for h in CACHE_HOOKS if not ctx.backend.implements(h)]
    if "pagedllm_allocate_host_kv_cache" in borrowed:  # core's fallback: the backend's own allocator on the host
        borrowed.remove("pagedllm_allocate_host_kv_cache")
        try:
            ctx.backend.allocate_host_kv_cache(replace(spec, device=torch.device("cpu")), False)
            ctx.notes.append("host caches: the backend's own allocator on the host (no "
                             "pagedllm_allocate_host_kv_cache)")
        except SwapUnsupported as e:  # core never swaps for it, so the swap hook is not needed
            borrowed = [h for h in borrowed if h != "pagedllm_swap_kv_blocks"]
            ctx.notes.append(str(e))
    if borrowed:
        raise CheckFailed(
            f"backend {ctx.backend.name!r} allocates its own KV layout ({layout_of(cache)}; canonical is "
            f"[2, num_blocks, block_size, num_kv_heads, head_size]) but {', '.join(borrowed)} resolve(s) to core's "
            f"reference op, which would index that layout as canonical: implement them in the backend")
    ctx.notes.append(f"own layout {layout_of(cache)}; every cache hook is the backend's own")
