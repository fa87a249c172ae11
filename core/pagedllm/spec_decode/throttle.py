"""The measured batch throttle: speculate at a batch size only while it pays there.

Why: at batch 1 a verification forward of ``k + 1`` tokens costs about a 1-token decode (weights are read once), so
any accepted draft is profit; at batch 64 the forward is compute-bound, ``k + 1`` query tokens per request cost
close to ``k + 1`` times as much, and even 70-80% acceptance can lose throughput. Where the crossover lies depends
on the device, the model, the proposer's own cost and the workload's acceptance, so it is measured rather than
modelled: for each batch-size bucket (1, 2-3, 4-7, ...) the engine's pure decode steps are timed with speculation
allowed and without, and a step speculates where the measured rate is the higher one. Each side's rate is the
median of its last ``WINDOW`` steps' tokens/s: one step stalled by the OS, a garbage collection or a first-use cost
does not decide for the next hundred. Each bucket first tries both (``WARMUP`` steps each), then keeps probing the
losing side, first after ``EXPLORE_FIRST`` steps and twice as long after each probe that loses, up to every
``EXPLORE_CLOSE`` steps while the two rates are within 10% of each other (every ``EXPLORE_FAR`` otherwise): a change
in workload early in a run (text that starts repeating) is noticed soon, and exploration later costs little. A probe
that beats the leading side is repeated at once, so a side that has started to win takes over within a few steps.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

WARMUP = 4
EXPLORE_FIRST = 8
EXPLORE_CLOSE = 32
EXPLORE_FAR = 128
WINDOW = 8


@dataclass
class _Arm:
    steps: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # tokens/s of the last WINDOW steps

    @property
    def rate(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0

    def add(self, tokens: int, seconds: float) -> float:
        r = tokens / max(seconds, 1e-9)
        self.recent.append(r)
        self.steps += 1
        return r


@dataclass
class _Bucket:
    on: _Arm
    off: _Arm
    since_explore: int = 0
    gap: int = EXPLORE_FIRST  # steps until the next probe, doubled by each losing one (capped in ``allow``)
    leader: Optional[bool] = None  # the side that led at the last decision; a new leader restarts the probe schedule


class BatchThrottle:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        # (bucket, speculation allowed, whether that is a probe of the losing side) of the running step
        self._pending: Optional[tuple[int, bool, bool]] = None
        self.steps_on = 0
        self.steps_off = 0

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(1, batch_size).bit_length()

    def allow(self, batch_size: int) -> bool:
        """Whether this step speculates (its outcome is reported by ``observe``)."""
        b = self.buckets.setdefault(self.bucket(batch_size), _Bucket(_Arm(), _Arm()))
        probe = False
        if b.on.steps < WARMUP:
            on = True
        elif b.off.steps < WARMUP:
            on = False
        else:
            best = b.on.rate >= b.off.rate
            if best != b.leader:
                b.leader, b.gap, b.since_explore = best, EXPLORE_FIRST, 0
            lo, hi = sorted((b.on.rate, b.off.rate))
            b.gap = min(b.gap, EXPLORE_CLOSE if lo >= 0.9 * hi else EXPLORE_FAR)
            b.since_explore += 1
            on = best
            if b.since_explore >= b.gap:
                b.since_explore, b.gap, on, probe = 0, 2 * b.gap, not best, True
        self._pending = (self.bucket(batch_size), on, probe)
        return on

    def cancel(self) -> None:
        """Forget an unreported decision (a step that ended early)."""
        self._pending = None

    def observe(self, tokens: int, seconds: float, decode_only: bool) -> None:
        """The step's emitted tokens and wall time; steps with prefill work are not comparable and are dropped."""
        pending, self._pending = self._pending, None
        if pending is None or not decode_only or tokens <= 0:
            return
        b = self.buckets[pending[0]]
        arm, other = (b.on, b.off) if pending[1] else (b.off, b.on)
        if arm.add(tokens, seconds) > other.rate and pending[2]:
            b.gap = 1  # the probe beat the leader: probe again next step
        if pending[1]:
            self.steps_on += 1
        else:
            self.steps_off += 1

    def rates(self) -> dict[int, tuple[float, float]]:
        """Bucket -> (tokens/s with speculation allowed, without), for stats and tests."""
        return {k: (b.on.rate, b.off.rate) for k, b in sorted(self.buckets.items())}
