"""vllm-gaudi's bucketing, mapped onto core's three-dimensional :class:`~pagedllm.backend.batch_policy.BucketPolicy`.

Every step the model sees is padded to a bucket triple (query tokens, sequences, block-table width), and every
triple is warmed up (captured) before serving, so the graph compiler never runs while serving. The bucket ranges
follow vllm-gaudi (vllm_gaudi/extension/bucketing/linear.py ``warmup_range``, exponential.py
``warmup_range_with_limit``), strategy chosen by ``VLLM_BUCKETING_STRATEGY`` (``exp``, the default, or ``lin``):

- sequences: vllm-gaudi's decode batch-size range (``VLLM_DECODE_BS_BUCKET_{MIN,STEP,MAX}`` under ``lin``);
- query tokens: the decode batch sizes (a decode step has one token per sequence) plus vllm-gaudi's prompt query
  range, which starts at one block (``VLLM_PROMPT_QUERY_BUCKET_{MIN,STEP,MAX}``);
- block-table width: blocks per sequence, like vllm-gaudi's prompt context-block range
  (``VLLM_PROMPT_CTX_BUCKET_{MIN,STEP,MAX}``). vllm-gaudi buckets the *total* decode blocks of a batch instead,
  because its decode path builds a flat block list on the host; here the flat list is built on the device from
  the block table (``flat_pa.flat_metadata``), so its length is tokens x width and bucketing the width bounds it.

Each range always ends at the engine's budget, so the largest bucket caps the scheduler (``Worker``).
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Sequence

from pagedllm.backend.batch_policy import BucketPolicy
from pagedllm.backend.hookspec import RunnerContext

STRATEGIES = ("exp", "lin")


def warmup_range(bmin: int, bstep: int, bmax: int) -> list[int]:
    """Linear strategy: double from ``bmin`` while below ``bstep``, then every ``bstep`` up to ``bmax``
    (vllm_gaudi/extension/bucketing/linear.py ``warmup_range``; e.g. 2, 32, 64 -> 2, 4, 8, 16, 32, 64)."""
    if not 1 <= bmin <= bmax or bstep < 1:
        raise ValueError(f"bucket range needs 1 <= min <= max and step >= 1, got min={bmin} step={bstep} max={bmax}")
    ramp = itertools.takewhile(lambda x: x < bstep and x <= bmax,
                               itertools.accumulate(itertools.repeat(2), lambda a, b: a * b, initial=bmin))
    return sorted({b for b in itertools.chain(ramp, range(bstep, bmax + 1, bstep)) if b >= bmin} | {bmax})


def warmup_range_with_limit(bmin: int, bstep: int, bmax: int, num_buckets: int) -> list[int]:
    """Exponential strategy: ``num_buckets`` values spaced geometrically from ``bmin`` to ``bmax``, each rounded up
    to a multiple of ``bstep``, duplicates dropped; a ``bmin`` of 1 is kept as its own bucket
    (vllm_gaudi/extension/bucketing/exponential.py ``warmup_range_with_limit``)."""
    if num_buckets <= 1 or bmax <= 1:
        return [bmax]
    keep_one = bmin == 1
    lo = bstep if keep_one else bmin
    lo = min(lo, bmax)
    out = {min(bmax, math.ceil(lo * (bmax / lo) ** (i / (num_buckets - 1)) / bstep) * bstep)
           for i in range(num_buckets)}
    if keep_one:
        out.add(1)
    return sorted(out | {bmax})


def read_bucket_settings(phase: str, dim: str, **defaults: int) -> tuple[int, int, int]:
    """``(min, step, max)`` from ``VLLM_{PHASE}_{DIM}_BUCKET_{MIN,STEP,MAX}``, else ``defaults``
    (vllm_gaudi/extension/bucketing/linear.py ``read_bucket_settings``)."""
    values = []
    for p in ("min", "step", "max"):
        env = f"VLLM_{phase}_{dim}_BUCKET_{p}".upper()
        raw = os.environ.get(env)
        try:
            values.append(int(raw) if raw is not None else defaults[p])
        except ValueError:
            raise ValueError(f"{env}={raw!r} is not an integer") from None
    return values[0], values[1], values[2]


def _log2_limit(n: int, extra: int = 1) -> int:
    return math.ceil(math.log2(n)) + extra if n > 1 else 1


def _clip(buckets: Sequence[int], top: int) -> tuple[int, ...]:
    return tuple(sorted({b for b in buckets if 1 <= b < top} | {top}))


def bucket_ranges(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
                  strategy: str | None = None) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(token_buckets, seq_buckets, block_buckets)`` for the engine's budgets."""
    strategy = strategy or os.environ.get("VLLM_BUCKETING_STRATEGY", "exp")
    if strategy not in STRATEGIES:
        raise ValueError(f"VLLM_BUCKETING_STRATEGY={strategy!r}: choose one of {STRATEGIES}")
    max_width = -(-max_model_len // block_size)
    q_min = min(block_size, max_num_batched_tokens)
    if strategy == "lin":
        seqs = warmup_range(*_capped(read_bucket_settings("decode", "bs", min=1, step=32, max=max_num_seqs),
                                     max_num_seqs))
        query = warmup_range(*_capped(read_bucket_settings("prompt", "query", min=q_min, step=q_min,
                                                           max=max_num_batched_tokens), max_num_batched_tokens))
        width = warmup_range(*_capped(read_bucket_settings("prompt", "ctx", min=1, step=4, max=max_width),
                                      max_width))
    else:  # exponential: the bucket counts follow vllm-gaudi's exponential.py (log2 of each range)
        seqs = warmup_range_with_limit(1, 2, max_num_seqs, _log2_limit(max_num_seqs))
        query = warmup_range_with_limit(q_min, q_min, max_num_batched_tokens, _log2_limit(max_num_batched_tokens, 0))
        width = warmup_range_with_limit(1, 1, max_width, _log2_limit(max_width))
    tokens = _clip(list(seqs) + list(query), max_num_batched_tokens)
    return tokens, _clip(seqs, max_num_seqs), _clip(width, max_width)


def _capped(cfg: tuple[int, int, int], top: int) -> tuple[int, int, int]:
    """A user's range never exceeds the engine's budget (the largest bucket caps the scheduler)."""
    lo, step, hi = cfg
    hi = min(hi, top)
    return min(lo, hi), step, hi


def gaudi_bucket_policy(ctx: RunnerContext) -> BucketPolicy:
    tokens, seqs, width = bucket_ranges(ctx.max_num_seqs, ctx.max_num_batched_tokens, ctx.max_model_len,
                                        ctx.block_size)
    return BucketPolicy(token_buckets=tokens, seq_buckets=seqs, block_buckets=width, block_size=ctx.block_size)
