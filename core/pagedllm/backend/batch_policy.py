"""Batch shapes a backend's model may see: dynamic (identity) or padded to buckets for static-shape devices.

A static-shape device (a graph compiler, device graphs) compiles or captures one program per input shape, so every
step must land on a shape compiled ahead of time. The policy pads a step's three dimensions — query tokens,
sequences, block-table width — each up to the smallest bucket that holds it (as vLLM's static-shape vendor plugins
bucket). The scheduler's budget is capped at the largest buckets, so no step can fall outside the set, and the
worker runs one forward per :meth:`BatchPolicy.warmup_shapes` shape before serving.
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass
from typing import NamedTuple


class BatchShape(NamedTuple):
    num_tokens: int  # query tokens in the step (rows of input_ids, positions, slot_mapping)
    num_seqs: int  # sequences (rows of block_tables, seq_lens; query_start_loc has one more)
    num_blocks: int  # block-table width


class BatchPolicy:
    """Identity: the model sees each step's exact shape (eager and dynamic-shape devices)."""

    static: bool = False

    def pad(self, shape: BatchShape) -> BatchShape:
        return shape

    def warmup_shapes(self) -> list[BatchShape]:
        return []

    def limits(self) -> BatchShape | None:
        """The largest shape (caps the scheduler's budget), or None when unbounded."""
        return None


def capped_pow2_buckets(max_value: int, min_value: int = 1) -> tuple[int, ...]:
    """The powers of two from ``min_value`` that are below ``max_value``, then ``max_value`` itself (the exponential
    bucketing of vLLM's static-shape plugins): the largest bucket is the budget, so no step pads past it —
    ``capped_pow2_buckets(100)`` is ``(1, 2, 4, 8, 16, 32, 64, 100)``."""
    if min_value < 1 or min_value & (min_value - 1):
        raise ValueError(f"min_value must be a power of two, got {min_value!r}")
    return _doubling_to(max_value, min_value)


def pow2_buckets(max_value: int, min_value: int = 1) -> tuple[int, ...]:
    """Deprecated name of :func:`capped_pow2_buckets`: its last bucket is ``max_value``, a power of two or not."""
    warnings.warn("pagedllm.backend.batch_policy.pow2_buckets is now capped_pow2_buckets (same buckets; pagedllm "
                  "issue 27); the old name goes with contract v3", DeprecationWarning, stacklevel=2)
    return _doubling_to(max_value, max(1, min_value))


def _doubling_to(max_value: int, start: int) -> tuple[int, ...]:
    out, b = [], start
    while b < max_value:
        out.append(b)
        b *= 2
    return tuple(out + [max_value])


def _bucket(buckets: tuple[int, ...], n: int, what: str) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True)
class BucketPolicy(BatchPolicy):
    """Pad each dimension to the smallest bucket that holds it; warm up every reachable combination."""

    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    block_buckets: tuple[int, ...]
    block_size: int
    static: bool = True

    def __post_init__(self) -> None:
        for name in ("token_buckets", "seq_buckets", "block_buckets"):
            b = getattr(self, name)
            if not b or list(b) != sorted(set(b)) or b[0] < 1:
                raise ValueError(f"{name} must be distinct increasing positive integers, got {b!r}")

    def pad(self, shape: BatchShape) -> BatchShape:
        return BatchShape(_bucket(self.token_buckets, shape.num_tokens, "num_tokens"),
                          _bucket(self.seq_buckets, shape.num_seqs, "num_seqs"),
                          _bucket(self.block_buckets, shape.num_blocks, "num_blocks"))

    def limits(self) -> BatchShape:
        return BatchShape(self.token_buckets[-1], self.seq_buckets[-1], self.block_buckets[-1])

    def warmup_shapes(self) -> list[BatchShape]:
        """Every bucket triple some real step can pad to: a step of ``T`` tokens over ``S`` sequences with a
        block table ``W`` wide has ``S <= T <= S * W * block_size``, and pads to ``(t, s, w)`` when each value lies
        above the previous bucket and at most this one."""
        def prev(buckets: tuple[int, ...], i: int) -> int:
            return buckets[i - 1] if i else 0

        tb, sb, wb = self.token_buckets, self.seq_buckets, self.block_buckets
        return [BatchShape(t, s, w) for i, t in enumerate(tb) for j, s in enumerate(sb) for w in wb
                if prev(sb, j) + 1 <= t and prev(tb, i) + 1 <= s * w * self.block_size]
