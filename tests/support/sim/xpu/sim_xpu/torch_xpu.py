"""Patch the ``torch.xpu`` surface pagedllm-xpu calls so its glue runs on a CPU-only torch (tests only).

Call :func:`install` in a fresh process (the test runner starts one per scenario). Tensors stay on the CPU: the
backend's device is mapped to ``cpu`` by :func:`cpu_backend`, and core's Triton kernels run under
``TRITON_INTERPRET=1``. ``torch.xpu.graph`` (the capture context manager) is torch's own code, driving the
simulated streams and :class:`~sim_xpu.graph_recorder.RecordingGraph`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from sim_xpu.graph_recorder import RecordingGraph, hook_triton_interpreter

DEVICE_NAME = "Intel(R) Data Center GPU Max 1550 (simulated)"


@dataclass
class SimState:
    """What the simulated runtime was asked, and the numbers it reports."""

    total_bytes: int = 64 << 30
    free_bytes: int = 60 << 30
    allocated_bytes: int = 1 << 20
    peak_bytes: int = 1 << 20
    bf16: bool = True
    calls: list = field(default_factory=list)


STATE = SimState()


class SimStream:
    """``torch.xpu.Stream`` stand-in: ordering is trivially kept on the host."""

    def __init__(self, device: Any = None, priority: int = 0):
        self.device = device

    def wait_stream(self, other: "SimStream") -> None:
        STATE.calls.append(("wait_stream",))

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> "SimStream":  # torch.xpu.graph enters its capture stream as a context manager
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_CURRENT = SimStream()


class _StreamContext:
    def __init__(self, stream: SimStream):
        self.stream = stream

    def __enter__(self) -> SimStream:
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        pass


def _record(name: str):
    def fn(*args: Any, **kwargs: Any) -> None:
        STATE.calls.append((name,) + tuple(str(a) for a in args))

    return fn


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    STATE.calls.append(("mem_get_info", str(device)))
    return STATE.free_bytes, STATE.total_bytes


def _max_memory_allocated(device: Any = None) -> int:
    STATE.calls.append(("max_memory_allocated", str(device)))
    return STATE.peak_bytes


def _reset_peak_memory_stats(device: Any = None) -> None:
    STATE.calls.append(("reset_peak_memory_stats", str(device)))
    STATE.peak_bytes = STATE.allocated_bytes


def install() -> SimState:
    """Patch ``torch.xpu`` in this process; returns the state the simulated runtime records into."""
    xpu = torch.xpu
    patches = dict(
        is_available=lambda: True, device_count=lambda: 1, get_device_name=lambda device=None: DEVICE_NAME,
        is_bf16_supported=lambda *a, **k: STATE.bf16, current_device=lambda: 0,
        mem_get_info=_mem_get_info, max_memory_allocated=_max_memory_allocated,
        reset_peak_memory_stats=_reset_peak_memory_stats, synchronize=_record("synchronize"),
        set_device=_record("set_device"), empty_cache=lambda: None,
        Stream=SimStream, current_stream=lambda device=None: _CURRENT, stream=_StreamContext,
        graph_pool_handle=lambda: ("sim-pool",), XPUGraph=RecordingGraph,
    )
    for name, value in patches.items():
        setattr(xpu, name, value)
    xpu.graph.default_capture_stream = None  # torch's context manager makes its own (simulated) stream
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        hook_triton_interpreter()
    return STATE


def cpu_backend(name: str = "xpu"):
    """The installed plugin's :class:`~pagedllm.backend.registry.Backend`, with its device mapped to the host."""
    from pagedllm.backend.registry import get_backend

    backend = get_backend(name)
    backend.device = lambda index=None: torch.device("cpu")  # tensors of the simulated device live on the host
    # Shim: core's conformance graph check calls graph_runner(model, n, device) without the v2 ``ctx`` argument,
    # which this plugin's hook requires (the Worker passes it). None is what a v1 caller gives make_graph_runner.
    hook = backend.graph_runner
    backend.graph_runner = lambda model, max_num_seqs, device, ctx=None: hook(model, max_num_seqs, device, ctx)
    return backend
