"""Simulated ``habana_frameworks.torch.core``: ``mark_step`` flushes nothing (ops ran eagerly); it is counted."""

from habana_frameworks.torch import _sim
from habana_frameworks.torch.hpu import _memory


def mark_step() -> None:
    _sim.STATS["mark_step"] += 1
    _memory.sample()
