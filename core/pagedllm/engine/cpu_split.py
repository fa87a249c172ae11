"""``--engine-cpus``: split a host's CPUs between the engine process and the HTTP process.

Why: streaming costs the HTTP process tens of microseconds of CPU per token. On CPUs the engine's torch threads also
use, every slice the HTTP process takes stalls the engine's whole OpenMP team at its next barrier, so the engine loses
more than the CPU taken (docs/benchmarks.md: 0.73-0.94 of offline throughput on 2 shared cores, 0.96-0.996 with
one core each). vLLM's CPU backend reserves front-end cores for the same reason.
"""

from __future__ import annotations

import os

import torch

from pagedllm.errors import ParamError
from pagedllm.distributed.binding import pin_process


def parse_cpu_list(text: str, field: str = "engine_cpus") -> frozenset[int]:
    """``"0-5,8"`` -> {0, 1, 2, 3, 4, 5, 8} (taskset / cpuset syntax); each CPU must be one this process may use."""
    if not hasattr(os, "sched_setaffinity"):
        raise ParamError(field, "CPU pinning needs os.sched_setaffinity (Linux); leave it unset here")
    cpus: set[int] = set()
    for part in str(text).split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ParamError(field, f"expected a CPU list such as 0-3,6, got {text!r}") from None
        if first < 0 or last < first:
            raise ParamError(field, f"bad CPU range {part.strip()!r} in {text!r}")
        cpus.update(range(first, last + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ParamError(field, f"CPUs {sorted(cpus - allowed)} are not available to this process "
                                f"(available: {sorted(allowed)})")
    return frozenset(cpus)


def pin_engine(cpus: frozenset[int]) -> int:
    """Run this (engine) process on ``cpus`` with one torch thread each; returns the torch thread count.

    Called before the model is built: OpenMP threads start on first use and inherit the main thread's CPU mask.
    """
    pin_process(cpus)
    torch.set_num_threads(len(cpus))
    return torch.get_num_threads()


def pin_front_end(engine_cpus: frozenset[int]) -> frozenset[int]:
    """Move this (HTTP) process off the engine's CPUs; returns its CPUs (all of them if none are left)."""
    rest = frozenset(os.sched_getaffinity(0) - engine_cpus)
    if rest:
        pin_process(rest)
        return rest
    return frozenset(os.sched_getaffinity(0))
