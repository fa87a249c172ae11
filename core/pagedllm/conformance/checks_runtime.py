"""Runtime checks: memory queries, allocator accounting, and graph replay against eager execution."""

from __future__ import annotations

import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.conformance.checks_kernels import NUM_KV_HEADS, allocate
from pagedllm.conformance.harness import CaseContext, CheckFailed, Untested
from pagedllm.conformance.tiny_model import TinyDecoder
from pagedllm.hookspec import KVCacheSpec, MemoryInfo


def check_memory_info(ctx: CaseContext) -> None:
    mi = ctx.backend.memory_info(ctx.device)
    if not isinstance(mi, MemoryInfo):
        raise CheckFailed(f"memory_info returned {type(mi).__name__}, not MemoryInfo")
    if not (isinstance(mi.total_bytes, int) and isinstance(mi.free_bytes, int)):
        raise CheckFailed(f"memory sizes must be int bytes: {mi}")
    if mi.total_bytes <= 0 or not 0 <= mi.free_bytes <= mi.total_bytes:
        raise CheckFailed(f"need total > 0 and 0 <= free <= total: {mi}")
    ctx.notes.append(f"total {mi.total_bytes / 2**30:.1f} GiB, free {mi.free_bytes / 2**30:.1f} GiB, "
                     f"pinned host {mi.pinned_host}")


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


def check_allocator(ctx: CaseContext) -> None:
    hs, bs, nb, layers = ctx.params["head_size"], ctx.params["block_size"], 5, 3
    spec = KVCacheSpec(layers, nb, bs, NUM_KV_HEADS, hs, ctx.dtype, ctx.device)
    caches = ctx.backend.allocate_kv_cache(spec)
    if len(caches) != layers:
        raise CheckFailed(f"{len(caches)} caches for {layers} layers")
    total = 0
    for i, cache in enumerate(caches):
        ts = _tensors(cache)
        if not ts:
            raise CheckFailed(f"layer {i}: cache holds no tensors ({type(cache).__name__})")
        for t in ts:
            if t.device.type != ctx.device.type:
                raise CheckFailed(f"layer {i}: tensor on {t.device}, backend device type is {ctx.device.type}")
            if t.dtype != ctx.dtype:
                raise CheckFailed(f"layer {i}: dtype {t.dtype}, asked for {ctx.dtype}")
            total += t.numel() * t.element_size()
        got = ctx.backend.gather_kv_blocks(cache, torch.arange(nb, device=ctx.device))
        want = (2, nb, bs, NUM_KV_HEADS, hs)
        if tuple(got.shape) != want or got.dtype != ctx.dtype:
            raise CheckFailed(f"layer {i}: gather_kv_blocks gives {tuple(got.shape)} {got.dtype}, canonical is {want}")
    if total != nb * spec.bytes_per_block:
        raise CheckFailed(f"caches hold {total} bytes; KVCacheSpec.bytes_per_block x num_blocks = "
                          f"{nb * spec.bytes_per_block} (core sizes the pool from bytes_per_block)")


def _decode_meta(seq_lens: list[int], tables: list[list[int]], bs: int, device) -> AttentionMetadata:
    return AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, bs, device=device)


def check_graph_replay(ctx: CaseContext) -> None:
    """Eager vs the backend's graph runner on decode steps of 3, 2, 3 and 1 sequences (bucket padding, repeated
    replays), plus a prefill that must take the eager path; outputs and cache writes must agree."""
    hs, bs = ctx.params["head_size"], ctx.params["block_size"]
    (cache,) = allocate(ctx, 12, bs, hs)
    if not isinstance(cache, torch.Tensor):
        raise Untested("cache is not a tensor: cannot snapshot it between eager and replayed runs")
    model = TinyDecoder(ctx.backend, cache, vocab=32, num_heads=2 * NUM_KV_HEADS, num_kv_heads=NUM_KV_HEADS,
                        head_size=hs, dtype=ctx.dtype, device=ctx.device, gen=ctx.gen)
    runner = ctx.backend.graph_runner(model, 4, ctx.device)
    tables = [[5, 2, 9], [0, 7, 11], [3, 8, 1]]
    lens = [5, bs + 2, 3]

    def step(ids: list[int], positions: list[int], meta: AttentionMetadata, what: str) -> None:
        ids_t = torch.tensor(ids, device=ctx.device)
        pos_t = torch.tensor(positions, device=ctx.device)
        before = cache.clone()
        eager = model(ids_t, pos_t, meta).clone()
        after_eager = cache.clone()
        cache.copy_(before)
        replayed = runner.run(ids_t, pos_t, meta).clone()
        ctx.backend.synchronize(ctx.device)
        ctx.compare(replayed, eager, f"{what}: hidden states")
        ctx.compare(cache, after_eager, f"{what}: KV cache after the step")

    prompt = [int(x) for x in ctx.randint(32, sum(lens)).tolist()]
    prefill = AttentionMetadata.build(lens, lens, tables, bs, device=ctx.device)
    step(prompt, [p for n in lens for p in range(n)], prefill, "prefill (eager path)")
    for active in ([0, 1, 2], [0, 2], [0, 1, 2], [1]):
        for i in active:
            lens[i] += 1
        meta = _decode_meta([lens[i] for i in active], [tables[i] for i in active], bs, ctx.device)
        ids = [int(x) for x in ctx.randint(32, len(active)).tolist()]
        step(ids, [lens[i] - 1 for i in active], meta, f"decode of {len(active)}")
    ctx.notes.append(f"runner level {runner.level!r}, stats {runner.stats}")
