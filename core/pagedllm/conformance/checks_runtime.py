"""Runtime checks: memory queries, allocator accounting, and graph replay against eager execution."""

from __future__ import annotations

import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.conformance.checks_kernels import NUM_KV_HEADS, allocate
from pagedllm.conformance.engine_context import pad_step, runner_context
from pagedllm.conformance.harness import CaseContext, CheckFailed, Untested, cache_locator, token_locator
from pagedllm.conformance.tiny_model import TinyDecoder
from pagedllm.backend.hookspec import KVCacheSpec, MemoryInfo


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


def _snapshot(cache) -> list[torch.Tensor]:
    return [t.clone() for t in _tensors(cache)]


def _restore(cache, snap: list[torch.Tensor]) -> None:
    for t, saved in zip(_tensors(cache), snap):
        t.copy_(saved)


def check_graph_replay(ctx: CaseContext) -> None:
    """Eager vs the backend's graph runner (called as the Worker calls it, with a RunnerContext and the backend's
    batch policy) on a prefill and decode steps of 3, 2, 3 and 1 sequences that span several blocks of the largest
    block size and cross a block boundary while decoding; steps are padded to the policy's buckets as the model
    runner pads them. Outputs and the cache (every block but the padding sink) must agree."""
    hs, bs = ctx.params["head_size"], ctx.params["block_size"]
    heads = 2 * NUM_KV_HEADS
    lens = [5, 2 * bs + 3, 3 * bs - 1]
    blocks_per_seq = 4  # 3 * bs - 1 + 4 decode steps needs 4 blocks
    nb = 3 * blocks_per_seq + 2
    sink = nb - 1  # never in a table: static backends pad into it
    perm = ctx.randperm(nb - 1)
    tables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(3)]
    max_len = blocks_per_seq * bs
    (cache,) = allocate(ctx, nb, bs, hs)
    if not _tensors(cache):
        raise Untested(f"cache is not made of torch tensors ({type(cache).__name__}): cannot snapshot it between "
                       f"eager and replayed runs")
    rctx = runner_context(ctx.backend, num_heads=heads, num_kv_heads=NUM_KV_HEADS, head_size=hs, vocab=32,
                          block_size=bs, max_model_len=max_len, max_num_seqs=4,
                          max_num_batched_tokens=sum(lens) + 8, dtype=ctx.dtype, device=ctx.device, sink_block=sink)
    model = TinyDecoder(ctx.backend, cache, vocab=32, num_heads=heads, num_kv_heads=NUM_KV_HEADS, head_size=hs,
                        dtype=ctx.dtype, device=ctx.device, gen=ctx.gen, max_pos=max_len)
    model.max_model_len = max_len
    runner = ctx.backend.graph_runner(model, 4, ctx.device, rctx)
    run = runner.run if runner is not None else model
    keep = torch.tensor([b for b in range(nb) if b != sink], device=ctx.device)

    def step(ids: list[int], positions: list[int], qlens: list[int], slens: list[int], tbls: list[list[int]],
             what: str) -> None:
        meta = AttentionMetadata.build(qlens, slens, tbls, bs, device=ctx.device)
        ids_t = torch.tensor(ids, device=ctx.device)
        pos_t = torch.tensor(positions, device=ctx.device)
        before = _snapshot(cache)
        eager = model(ids_t, pos_t, meta).clone()
        after_eager = ctx.backend.gather_kv_blocks(cache, keep).clone()
        _restore(cache, before)
        p_ids, p_pos, p_meta = pad_step(rctx, ids, positions, qlens, slens, tbls)
        replayed = run(p_ids, p_pos, p_meta)[: len(ids)].clone()
        ctx.backend.synchronize(ctx.device)
        ctx.compare(replayed, eager, f"{what}: hidden states", where=token_locator(meta, hs))
        ctx.compare(ctx.backend.gather_kv_blocks(cache, keep), after_eager, f"{what}: KV cache after the step",
                    where=lambda idx: cache_locator(idx) + " (index into the non-sink blocks)")

    prompt = [int(x) for x in ctx.randint(32, sum(lens)).tolist()]
    with torch.inference_mode():  # as the Worker runs every step
        _steps(step, prompt, lens, tables, ctx)
    ctx.notes.append(f"runner level {getattr(runner, 'level', 'none')!r}, policy {type(rctx.policy).__name__}, "
                     f"stats { {k: v for k, v in getattr(runner, 'stats', {}).items() if k != 'shapes_seen'} }")


def _steps(step, prompt: list[int], lens: list[int], tables: list[list[int]], ctx: CaseContext) -> None:
    step(prompt, [p for n in lens for p in range(n)], lens, lens, tables, "prefill")
    for active in ([0, 1, 2], [0, 2], [0, 1, 2], [1]):  # sequence 2 enters block 3 at the second
        for i in active:
            lens[i] += 1
        ids = [int(x) for x in ctx.randint(32, len(active)).tolist()]
        step(ids, [lens[i] - 1 for i in active], [1] * len(active), [lens[i] for i in active],
             [tables[i] for i in active], f"decode of {len(active)} (lengths {[lens[i] for i in active]})")
