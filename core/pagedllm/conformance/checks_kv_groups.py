"""KV cache groups (contract v4): the backend's ``allocate_kv_cache_groups`` (through the registry, which checks a
backend's own return; a backend without the hook runs core's reference path from its ``allocate_kv_cache`` /
``allocate_state_cache``) on a :class:`KVCacheConfig` laid out as core lays one out, then its caches used end to end
by the backend's own kernels against core's reference ops on the same inputs.

The full + sliding-window case shares each tensor between one full and one sliding layer (``shared_by`` of 2, core's
layout: the groups take disjoint blocks of one pool, the sliding table holds the null block 0 for blocks out of the
window). Every layer is written before any is read, so a cache where two layers alias blocks the layout does not let
them share (two layers of one group, written at the same slots) shows as a wrong attention output. A backend's own
unshared layout is fine: only each layer's attention is compared."""

from __future__ import annotations

import torch

from pagedllm.backend import conv_ops, ref_ops
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                       MambaSpec, MLAAttentionSpec, SlidingWindowSpec)
from pagedllm.conformance.harness import CaseContext, CheckFailed, poison, poison_allocator, token_locator
from pagedllm.conformance.checks_kernels import NUM_KV_HEADS, scenario_lengths

#: The hooks the group cases exercise (reference fallback only when the backend implements none of them).
GROUP_HOOKS = ("pagedllm_allocate_kv_cache_groups", "pagedllm_allocate_kv_cache")
#: Layers of the full + sliding case: full attention on the odd layers, a window on the even (Gemma-3-like).
FULL_LAYERS, SLIDING_LAYERS = (1, 3), (0, 2)


def allocator_path(ctx: CaseContext) -> str:
    if ctx.backend.implements("pagedllm_allocate_kv_cache_groups"):
        return "the backend's own pagedllm_allocate_kv_cache_groups (its return checked by the registry)"
    return ("core's reference allocator path (no pagedllm_allocate_kv_cache_groups: the groups' caches from "
            "its allocate_kv_cache / allocate_state_cache)")


def allocate(ctx: CaseContext, config: KVCacheConfig) -> dict:
    """The caches of every layer, through the registry (which refuses a bad own return), every one poisoned."""
    ctx.notes.append(allocator_path(ctx))
    caches = ctx.backend.allocate_kv_cache_groups(config)
    if not isinstance(caches, dict):
        raise CheckFailed(f"allocate_kv_cache_groups returned {type(caches).__name__}, not a dict")
    missing = [i for i in config.layer_ids if i not in caches]
    extra = sorted(set(caches) - set(config.layer_ids), key=str)
    if missing or extra:
        raise CheckFailed(f"allocate_kv_cache_groups: layers {missing} missing, {extra} in no group "
                          f"(groups {[list(g.layer_ids) for g in config.kv_cache_groups]})")
    for layer in config.layer_ids:
        if not isinstance(config.group_of(layer).kv_cache_spec, MambaSpec) and not poison(caches[layer]):
            ctx.notes.append("cache is not made of float tensors: unwritten slots are not poisoned")
    return caches


def _tables(seq_lens: list[int], query_lens: list[int], bs: int, window: int,
            pool: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Block tables of the full and the sliding group from one shuffled pool (disjoint blocks); the sliding table
    holds the null block 0 for every block no query of its sequence can see (core frees those)."""
    full, sliding, k = [], [], 0
    for s in seq_lens:
        n = -(-s // bs)
        full.append(pool[k:k + n])
        k += n
    for s, q in zip(seq_lens, query_lens):
        first = max(0, s - q - window) // bs  # the first block a query of this chunk can read (one key spare)
        n = -(-s // bs)
        sliding.append([0] * first + pool[k:k + n - first])
        k += n - first
    return full, sliding


def _slots(tables: list[list[int]], seq_lens: list[int], bs: int) -> torch.Tensor:
    """The slot of every context token (-1 in a null block: that token left the window before this step)."""
    return torch.tensor([bt[p // bs] * bs + p % bs if bt[p // bs] else -1
                         for bt, s in zip(tables, seq_lens) for p in range(s)], dtype=torch.int64)


def full_sliding_config(ctx: CaseContext, num_blocks: int) -> KVCacheConfig:
    hs, bs, window = ctx.params["head_size"], ctx.params["block_size"], ctx.params["sliding_window"]
    page = dict(block_size=bs, num_kv_heads=NUM_KV_HEADS, head_size=hs, dtype=ctx.dtype)
    groups = (KVCacheGroupSpec(FULL_LAYERS, FullAttentionSpec(**page)),
              KVCacheGroupSpec(SLIDING_LAYERS, SlidingWindowSpec(**page, sliding_window=window)))
    size = groups[0].kv_cache_spec.page_size_bytes * num_blocks
    shared = tuple(KVCacheTensor(size, pair) for pair in zip(FULL_LAYERS, SLIDING_LAYERS))
    return KVCacheConfig(num_blocks, shared, groups, ctx.device)


def check_full_and_sliding(ctx: CaseContext) -> None:
    """A full group and a sliding-window group sharing tensors: every layer's K/V written with the backend's
    ``write_kv`` (at its group's slots), then every layer's ``paged_attention`` against core's reference on a
    canonical cache of its own."""
    hs, bs, window, g = (ctx.params[k] for k in ("head_size", "block_size", "sliding_window", "gqa"))
    query_lens, seq_lens = scenario_lengths("mixed", bs)
    needed = 2 * sum(-(-s // bs) for s in seq_lens)
    num_blocks = needed + 3  # block 0 (null) and spares nobody uses
    pool = [b + 1 for b in ctx.randperm(num_blocks - 1)]
    full_t, sliding_t = _tables(seq_lens, query_lens, bs, window, pool)
    metas = {"full": AttentionMetadata.build(query_lens, seq_lens, full_t, bs, device=ctx.device),
             "sliding_window": AttentionMetadata.build(query_lens, seq_lens, sliding_t, bs, device=ctx.device)}
    slots = {"full": _slots(full_t, seq_lens, bs).to(ctx.device),
             "sliding_window": _slots(sliding_t, seq_lens, bs).to(ctx.device)}
    config = full_sliding_config(ctx, num_blocks)
    caches = allocate(ctx, config)
    n, refs = sum(seq_lens), {}
    for layer in sorted(config.layer_ids):  # interleaved across groups: sliding 0, full 1, sliding 2, full 3
        kind = config.group_of(layer).kind
        key, value = ctx.randn(n, NUM_KV_HEADS, hs), ctx.randn(n, NUM_KV_HEADS, hs)
        ctx.backend.write_kv(key, value, caches[layer], slots[kind], 1.0, 1.0)
        refs[layer] = torch.full((2, num_blocks, bs, NUM_KV_HEADS, hs), float("nan"), dtype=ctx.dtype,
                                 device=ctx.device)
        ref_ops.write_kv(key, value, refs[layer], slots[kind], 1.0, 1.0)
    scale = hs ** -0.5
    for layer in sorted(config.layer_ids):
        kind = config.group_of(layer).kind
        w = window if kind == "sliding_window" else None
        meta = metas[kind]
        query = ctx.randn(meta.num_tokens, NUM_KV_HEADS * g, hs)
        poison_allocator(query.numel(), ctx.dtype, ctx.device)
        out = ctx.backend.paged_attention(query, caches[layer], meta, scale, w, None, 1.0, 1.0)
        ref = ref_ops.paged_attention(query, refs[layer], meta, scale, w, None, 1.0, 1.0)
        partner = next(t.shared_by for t in config.kv_cache_tensors if layer in t.shared_by)
        try:
            ctx.compare(out, ref, f"attention output of layer {layer} ({kind} group)",
                        where=token_locator(meta, hs))
        except CheckFailed as e:
            raise CheckFailed(f"{e} [after writing every layer of the config; core's layout shares a tensor only "
                              f"between layers {list(partner)}, at disjoint blocks: a cache where another layer's "
                              f"writes land in this layer's blocks breaks it]") from None
    ctx.notes.append(f"layers {list(FULL_LAYERS)} full, {list(SLIDING_LAYERS)} window {window}; tensors shared by "
                     f"{[list(t.shared_by) for t in config.kv_cache_tensors]}; every layer's attention equals the "
                     "reference after all layers were written")


def check_mla_group(ctx: CaseContext) -> None:
    """An MLA group of two layers: latent rows through ``write_mla_kv`` into each layer's cache, then
    ``mla_attention`` per layer against the references."""
    latent, rope, heads, bs = (ctx.params[k] for k in ("kv_lora_rank", "rope", "heads", "block_size"))
    width = latent + rope
    query_lens, seq_lens = scenario_lengths("mixed", bs)
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 3
    pool = [b + 1 for b in ctx.randperm(num_blocks - 1)]
    tables, k = [], 0
    for s in seq_lens:
        tables.append(pool[k:k + -(-s // bs)])
        k += -(-s // bs)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, bs, device=ctx.device)
    slots = _slots(tables, seq_lens, bs).to(ctx.device)
    spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=width, dtype=ctx.dtype)
    layers = (0, 1)
    config = KVCacheConfig(num_blocks, tuple(KVCacheTensor(spec.page_size_bytes * num_blocks, (i,)) for i in layers),
                           (KVCacheGroupSpec(layers, spec),), ctx.device)
    caches = allocate(ctx, config)
    refs = {}
    for layer in layers:
        rows = ctx.randn(slots.shape[0], width)
        ctx.backend.write_mla_kv(rows, caches[layer], slots)
        refs[layer] = torch.full((1, num_blocks, bs, 1, width), float("nan"), dtype=ctx.dtype, device=ctx.device)
        ref_ops.write_mla_kv(rows, refs[layer], slots)
    scale = width ** -0.5
    for layer in layers:
        query = ctx.randn(meta.num_tokens, heads, width)
        poison_allocator(query.numel(), ctx.dtype, ctx.device)
        ctx.compare(ctx.backend.mla_attention(query, caches[layer], meta, scale, latent),
                    ref_ops.mla_attention(query, refs[layer], meta, scale, latent),
                    f"mla_attention output of layer {layer}", where=token_locator(meta, latent))


def check_state_group(ctx: CaseContext) -> None:
    """A full-attention layer between two conv-state layers (LFM2-like): each state layer's tensor the logical
    ``[num_slots, dim, width - 1]``, and ``causal_conv1d_update`` on one layer changes that layer's state only."""
    dim, width, bs, hs = (ctx.params[k] for k in ("dim", "width", "block_size", "head_size"))
    num_slots, num_blocks = 6, 4
    page = FullAttentionSpec(block_size=bs, num_kv_heads=NUM_KV_HEADS, head_size=hs, dtype=ctx.dtype)
    state = MambaSpec(2, num_slots, ((dim, width - 1),), (ctx.dtype,), ctx.device)
    config = KVCacheConfig(num_blocks, (KVCacheTensor(page.page_size_bytes * num_blocks, (1,)),),
                           (KVCacheGroupSpec((1,), page), KVCacheGroupSpec((0, 2), state)), ctx.device)
    caches = allocate(ctx, config)
    refs = {}
    for layer in (0, 2):
        cache = caches[layer]
        if not isinstance(cache, (tuple, list)) or len(cache) != 1 or not isinstance(cache[0], torch.Tensor) \
                or tuple(cache[0].shape) != (num_slots, dim, width - 1):
            raise CheckFailed(f"state layer {layer}: want a tuple of one tensor of logical shape "
                              f"{(num_slots, dim, width - 1)}, got {cache!r:.200}")
        cache[0].copy_(ctx.randn(num_slots, dim, width - 1))
        refs[layer] = cache[0].detach().clone().contiguous()
    weight, bias = ctx.randn(dim, width, scale=0.5), ctx.randn(dim)
    for layer, slots in ((0, [3, -1, 0]), (2, [1, 5])):
        x = ctx.randn(len(slots), dim)
        idx = torch.tensor(slots, dtype=torch.int32, device=ctx.device)
        out = ctx.backend.causal_conv1d_update(x, caches[layer][0], weight, bias, "silu", idx)
        ref = conv_ops.causal_conv1d_update(x, refs[layer], weight, bias, "silu", idx)
        real = torch.tensor([i for i, s in enumerate(slots) if s >= 0], dtype=torch.long, device=ctx.device)
        ctx.compare(out.index_select(0, real) if isinstance(out, torch.Tensor) else out, ref.index_select(0, real),
                    f"causal_conv1d_update output of state layer {layer}")
        for other in (0, 2):  # the other layer's state must not move
            ctx.compare(caches[other][0], refs[other], f"conv state of layer {other} after an update of layer "
                        f"{layer}", where=lambda i: f"slot {i[0]}, channel {i[1]}, history {i[2]}")
