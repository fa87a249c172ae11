"""Simulated ACL graphs: ``torch.npu.NPUGraph`` records the aten ops a captured region runs (a dispatch mode) and
replays them on the same tensors, as a device graph replays its kernels on the same addresses. Host values a
kernel took at capture (Python ints, host tensors) stay baked into the recording — exactly why vllm-ascend updates
``_npu_paged_attention``'s context lengths before every replay with ``graph_task_update_begin/end`` on a task group
captured between ``graph_task_group_begin/end``; the simulation replaces that group's recorded ops with the ones the
update issues. Host syncs (``.item()``, ``.tolist()`` of a device tensor, ``torch.equal``) inside a capture raise, as
they do on a device. Streams and events exist for the API's sake: every simulated op completes synchronously.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
_HOST_SYNC = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}


class _Group:
    """A task group: the ops one captured kernel call issued; an update swaps them for new ones."""

    def __init__(self) -> None:
        self.ops: list = []


class _Recorder(TorchDispatchMode):
    def __init__(self, sink: list) -> None:
        super().__init__()
        self.sinks = [sink]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_SYNC:
            raise RuntimeError(f"{func}: host synchronization inside an ACL graph capture (simulated npu)")
        out = func(*args, **kwargs)
        self.sinks[-1].append((func, args, kwargs, out))
        return out


_state: dict[str, Any] = {"recorder": None, "graph": None, "update": None}


def capturing() -> bool:
    return _state["recorder"] is not None


def _copy_into(dst: Any, src: Any) -> None:
    dsts, _ = tree_flatten(dst)
    srcs, _ = tree_flatten(src)
    for d, s in zip(dsts, srcs):
        if isinstance(d, torch.Tensor) and d is not s:
            d.copy_(s)


class NPUGraph:
    def __init__(self) -> None:
        self.items: list = []
        self.captured = False

    def capture_begin(self, pool: Any = None) -> None:
        if capturing():
            raise RuntimeError("nested ACL graph capture (simulated npu)")
        rec = _Recorder(self.items)
        rec.__enter__()
        _state.update(recorder=rec, graph=self)

    def capture_end(self) -> None:
        _state["recorder"].__exit__(None, None, None)
        _state.update(recorder=None, graph=None)
        self.captured = True

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("replay of a graph that was never captured (simulated npu)")
        with torch.inference_mode():
            for item in self.items:
                for func, args, kwargs, out in (item.ops if isinstance(item, _Group) else [item]):
                    _copy_into(out, func(*args, **kwargs))


@contextmanager
def graph(npu_graph: NPUGraph, pool: Any = None, stream: Any = None) -> Iterator[NPUGraph]:
    npu_graph.capture_begin(pool)
    try:
        yield npu_graph
    finally:
        npu_graph.capture_end()


def graph_pool_handle() -> object:
    return object()


class Stream:
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = device

    def wait_stream(self, other: "Stream") -> None:
        pass

    def synchronize(self) -> None:
        pass


_default_stream = Stream()
_current = [_default_stream]


def current_stream(device: Any = None) -> Stream:
    return _current[-1]


@contextmanager
def stream(s: Optional[Stream]) -> Iterator[None]:
    _current.append(s or _current[-1])
    try:
        yield
    finally:
        _current.pop()


class ExternalEvent:
    """Orders the update stream before the graph's kernel on a device; a no-op here (everything is synchronous)."""

    def wait(self, stream: Stream) -> None:
        pass

    def reset(self, stream: Stream) -> None:
        pass

    def record(self, stream: Stream) -> None:
        pass


def graph_task_group_begin(stream: Stream) -> None:
    rec = _state["recorder"]
    if rec is None:
        raise RuntimeError("graph_task_group_begin outside a capture (simulated npu)")
    group = _Group()
    rec.sinks[-1].append(group)
    rec.sinks.append(group.ops)


def graph_task_group_end(stream: Stream) -> _Group:
    rec = _state["recorder"]
    rec.sinks.pop()
    return rec.sinks[-1][-1]


def graph_task_update_begin(stream: Stream, handle: _Group) -> None:
    if capturing() or _state["update"] is not None:
        raise RuntimeError("graph_task_update_begin inside a capture or another update (simulated npu)")
    new_ops: list = []
    rec = _Recorder(new_ops)
    rec.__enter__()
    _state["update"] = (rec, handle, new_ops)


def graph_task_update_end(stream: Stream) -> None:
    rec, handle, new_ops = _state["update"]
    rec.__exit__(None, None, None)
    _state["update"] = None
    handle.ops = new_ops
