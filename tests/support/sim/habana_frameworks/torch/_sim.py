"""Counters the tests read (simulation only)."""

STATS = {"mark_step": 0, "captures": 0, "replays": 0, "recorded_ops": 0, "synchronize": 0}


def reset() -> None:
    for k in STATS:
        STATS[k] = 0
