"""Per-rank binding on a host: each rank of a CPU engine gets its own cores, one torch thread per core, so ranks
never fight over cores (and their OpenMP teams never wait on each other's slices); on an accelerator each rank and
each data-parallel replica gets its own device."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch


def pin_process(cpus: frozenset[int]) -> None:
    """Every thread of this process, not only the caller (imports already started helper threads; Linux lists them
    in /proc/self/task, elsewhere only the calling thread is moved). Threads started later inherit the mask."""
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def rank_cpu_sets(world_size: int) -> list[Optional[frozenset[int]]]:
    """An equal, disjoint share of this process's CPUs per rank; None each when there are fewer CPUs than ranks."""
    if not hasattr(os, "sched_getaffinity"):
        return [None] * world_size
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // world_size
    if per == 0:
        return [None] * world_size
    return [frozenset(cpus[r * per:(r + 1) * per]) for r in range(world_size)]


def bind_rank(cpus: Optional[frozenset[int]]) -> int:
    """Pin this process to ``cpus`` with that many torch threads (one thread if unpinned); returns the thread count."""
    if cpus:
        pin_process(cpus)
        torch.set_num_threads(len(cpus))
    else:
        torch.set_num_threads(1)
    return torch.get_num_threads()


def local_device(backend: Any, local_index: int) -> torch.device:
    """The device of this host's rank / replica number ``local_index``: ``torch.device(type, local_index)`` where the
    backend's device type is indexed (every accelerator), the backend's one device on CPU (all ranks share it)."""
    device = backend.device()
    return device if device.type == "cpu" else backend.device(local_index)


def local_index(config: Any, rank: int) -> int:
    """Rank ``rank`` of data-parallel replica ``config.data_parallel_rank`` on one host: replica ``d``'s ranks take
    devices ``[d * world, (d + 1) * world)`` (vLLM's order)."""
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    return config.data_parallel_rank * world + rank
