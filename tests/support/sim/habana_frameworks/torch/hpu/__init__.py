"""Simulated ``habana_frameworks.torch.hpu`` (tests only): device queries, streams, HPU graphs, memory stats.

Signatures follow HabanaAI/gaudi-pytorch-bridge python_packages/habana_frameworks/torch/hpu/{__init__,graphs,
memory,streams}.py; one simulated device.
"""

from contextlib import contextmanager

from habana_frameworks.torch import _sim
from habana_frameworks.torch.hpu._graphs import HPUGraph, graph  # noqa: F401
from habana_frameworks.torch.hpu._memory import (max_memory_allocated, mem_get_info, memory_allocated,  # noqa: F401
                                                 memory_stats, reset_peak_memory_stats)


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def get_device_name(device=None) -> str:
    return "GAUDI (simulated)"


def synchronize() -> None:  # no device argument, as the bridge's
    _sim.STATS["synchronize"] += 1


class Stream:
    def __init__(self, device=None):
        self.device = device


@contextmanager
def stream(s):
    yield s
