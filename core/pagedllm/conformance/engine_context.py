"""What the engine hands a backend's graph runner, rebuilt for conformance: a :class:`RunnerContext` (as
``Worker._context`` builds it) with the backend's own batch policy, and steps padded to that policy's buckets exactly
as ``ModelRunner.prepare`` pads them (padding tokens write to the sink slot, padding sequences have length 0)."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.registry import Backend
from pagedllm.backend.batch_policy import BatchPolicy, BatchShape
from pagedllm.config import EngineConfig
from pagedllm.backend.hookspec import ModelInfo, RunnerContext

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def runner_context(backend: Backend, *, num_heads: int, num_kv_heads: int, head_size: int, vocab: int,
                   block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                   dtype: torch.dtype, device: torch.device, sink_block: Optional[int] = None) -> RunnerContext:
    """The context with the backend's batch policy; ``pad_slot`` is ``sink_block``'s first slot under a static
    policy (the block must exist in the cache and belong to no sequence), else -1."""
    name = DTYPE_NAMES.get(dtype, "float32")
    config = EngineConfig(device=backend.name, dtype=name, block_size=block_size, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          skip_tokenizer_init=True)
    info = ModelInfo("ConformanceTinyDecoder", name, 1, num_heads, num_kv_heads, head_size, vocab, max_model_len)
    ctx = RunnerContext(config, info, max_model_len, block_size, max_num_seqs, max_num_batched_tokens, dtype,
                        device, BatchPolicy())
    policy = backend.batch_policy(ctx)
    pad_slot = sink_block * block_size if policy.static and sink_block is not None else -1
    return replace(ctx, policy=policy, pad_slot=pad_slot)


def pad_step(ctx: RunnerContext, ids: list[int], positions: list[int], query_lens: list[int], seq_lens: list[int],
             tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step padded to the policy's bucket (identity for a dynamic policy)."""
    width = max(len(t) for t in tables)
    real = BatchShape(len(ids), len(seq_lens), width)
    t, s, w = ctx.policy.pad(real)
    pad_t, pad_s = t - real.num_tokens, s - real.num_seqs
    slots = [tb[p // ctx.block_size] * ctx.block_size + p % ctx.block_size
             for q, n, tb in zip(query_lens, seq_lens, tables) for p in range(n - q, n)]
    meta = AttentionMetadata.build(list(query_lens) + [0] * pad_s, list(seq_lens) + [0] * pad_s,
                                   [list(tb) + [0] * (w - len(tb)) for tb in tables] + [[0] * w] * pad_s,
                                   ctx.block_size, device=ctx.device, slot_mapping=slots + [ctx.pad_slot] * pad_t)
    ids_t = torch.tensor(list(ids) + [0] * pad_t, dtype=torch.long, device=ctx.device)
    pos_t = torch.tensor(list(positions) + [0] * pad_t, dtype=torch.long, device=ctx.device)
    return ids_t, pos_t, meta
