"""The measured batch throttle: speculate at a batch size only while it pays there.

Why: at batch 1 a verification forward of ``k + 1`` tokens costs about a 1-token decode (weights are read once), so
any accepted draft is profit; at batch 64 the forward is compute-bound, ``k + 1`` query tokens per request cost
close to ``k + 1`` times as much, and even 70-80% acceptance can lose throughput. Where the crossover lies depends
on the device, the model, the proposer's own cost and the workload's acceptance, so it is measured rather than
modelled: for each batch-size bucket (1, 2-3, 4-7, ...) the engine's pure decode steps are timed with speculation
allowed and without, as an EMA of emitted tokens over an EMA of seconds, and a step speculates where the measured
rate is the higher one. Each bucket first tries both (``WARMUP`` steps each), then keeps trying the losing side
every ``EXPLORE_CLOSE`` steps while the two rates are within 10% of each other (every ``EXPLORE_FAR`` otherwise),
so a change in workload is noticed and exploration costs little.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

WARMUP = 4
EXPLORE_CLOSE = 32
EXPLORE_FAR = 128
_ALPHA = 0.2


@dataclass
class _Arm:
    steps: int = 0
    tokens: float = 0.0  # EMA of tokens emitted per step
    seconds: float = 0.0  # EMA of step seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, tokens: int, seconds: float) -> None:
        a = 1.0 if self.steps == 0 else _ALPHA
        self.tokens += a * (tokens - self.tokens)
        self.seconds += a * (seconds - self.seconds)
        self.steps += 1


@dataclass
class _Bucket:
    on: _Arm
    off: _Arm
    since_explore: int = 0


class BatchThrottle:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self._pending: Optional[tuple[int, bool]] = None  # (bucket, speculation allowed) of the running step
        self.steps_on = 0
        self.steps_off = 0

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(1, batch_size).bit_length()

    def allow(self, batch_size: int) -> bool:
        """Whether this step speculates (its outcome is reported by ``observe``)."""
        b = self.buckets.setdefault(self.bucket(batch_size), _Bucket(_Arm(), _Arm()))
        if b.on.steps < WARMUP:
            on = True
        elif b.off.steps < WARMUP:
            on = False
        else:
            best = b.on.rate >= b.off.rate
            lo, hi = sorted((b.on.rate, b.off.rate))
            every = EXPLORE_CLOSE if lo >= 0.9 * hi else EXPLORE_FAR
            b.since_explore += 1
            on = best
            if b.since_explore >= every:
                b.since_explore, on = 0, not best
        self._pending = (self.bucket(batch_size), on)
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
        (b.on if pending[1] else b.off).add(tokens, seconds)
        if pending[1]:
            self.steps_on += 1
        else:
            self.steps_off += 1

    def rates(self) -> dict[int, tuple[float, float]]:
        """Bucket -> (tokens/s with speculation allowed, without), for stats and tests."""
        return {k: (b.on.rate, b.off.rate) for k, b in sorted(self.buckets.items())}
