"""A recording device graph for CPU tensors: capture logs aten ops and Triton launches, replay re-issues them.

A real XPU/CUDA graph records the device work a region issues, with its memory addresses, and replays that work
without running the host code again. This does the same on the host: during capture a ``TorchDispatchMode`` logs
every aten call (function, the very argument tensors, the output tensors) and a hook on Triton's interpreter logs
every kernel launch; replay calls them again in order and copies fresh results into the captured output tensors,
so later ops (which hold those tensors) see the new values. Host values read while capturing stay baked in, and a
host sync during capture raises — both exactly what breaks a real device graph.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: Ops that need a device->host sync or produce data-dependent shapes: illegal inside device-graph capture.
SYNC_OPS = {torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default,
            torch.ops.aten.nonzero.default,
            torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}


class HostSyncInCapture(RuntimeError):
    """The captured region read a device value on the host (``.item()``, ``bool(t)``, ``nonzero``)."""


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class _AtenOp:
    def __init__(self, func: Any, args: tuple, kwargs: dict, out: Any):
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out

    def replay(self) -> None:
        res = self.func(*self.args, **self.kwargs)
        for new, old in zip(tree_leaves(res), tree_leaves(self.out)):
            if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and not _same_memory(new, old):
                old.copy_(new)


class _Launch:
    def __init__(self, run: Callable, kernel: Any, args: tuple, kwargs: dict):
        self.run, self.kernel, self.args, self.kwargs = run, kernel, args, kwargs

    def replay(self) -> None:
        self.run(self.kernel, *self.args, **self.kwargs)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: "RecordingGraph"):
        super().__init__()
        self.graph = graph
        self.in_launch = 0  # >0 while a recorded Triton launch runs: its internal host copies are not work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.in_launch and func in SYNC_OPS:
            raise HostSyncInCapture(f"{func} during graph capture: a host sync / data-dependent shape cannot be "
                                    "captured in a device graph")
        out = func(*args, **kwargs)
        if not self.in_launch:
            self.graph.ops.append(_AtenOp(func, args, kwargs, out))
        return out


_active: Optional[_Recorder] = None
_orig_run: Optional[Callable] = None


def _patched_run(kernel: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
    rec = _active
    if rec is None or warmup:
        return _orig_run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
    rec.in_launch += 1
    try:
        out = _orig_run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
    finally:
        rec.in_launch -= 1
    rec.graph.ops.append(_Launch(_orig_run, kernel, args, dict(kwargs, grid=grid, warmup=warmup)))
    rec.graph.launches += 1
    return out


def hook_triton_interpreter() -> None:
    """Route Triton interpreter launches through the recorder (a pass-through when nothing is capturing)."""
    global _orig_run
    if _orig_run is not None:
        return
    from triton.runtime.interpreter import InterpretedFunction

    _orig_run = InterpretedFunction.run
    InterpretedFunction.run = _patched_run


class RecordingGraph:
    """Stands in for ``torch.xpu.XPUGraph``: ``capture_begin(pool)``, ``capture_end()``, ``replay()``, ``pool()``."""

    instances: list = []

    def __init__(self, keep_graph: bool = False):
        self.ops: list = []
        self.launches = 0
        self.replays = 0
        self._rec: Optional[_Recorder] = None
        self._pool: Any = None
        RecordingGraph.instances.append(self)

    def capture_begin(self, pool: Any = None) -> None:
        global _active
        if _active is not None:
            raise RuntimeError("only one graph capture may be underway at a time")
        self._pool = pool
        self._rec = _Recorder(self)
        self._rec.__enter__()
        _active = self._rec

    def capture_end(self) -> None:
        global _active
        _active = None
        self._rec.__exit__(None, None, None)
        self._rec = None

    def replay(self) -> None:
        if self._rec is not None:
            raise RuntimeError("replay() during capture")
        with torch.inference_mode():
            for op in self.ops:
                op.replay()
        self.replays += 1

    def pool(self) -> Any:
        return self._pool

    def reset(self) -> None:
        self.ops.clear()
