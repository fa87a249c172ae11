"""The simulated ``torch.npu`` / ``torch_npu.npu`` device module: the surface ``plugins/ascend`` calls (memory
queries, peak stats, set_device, synchronize, device count and name, and ACL graphs: ``_graph.py``). Total
memory is a fixed 32 GiB; free is that less the bytes held by live simulated device storages."""

from __future__ import annotations

import sys
from typing import Any

from torch_npu import _device
from torch_npu._graph import (ExternalEvent, NPUGraph, Stream, current_stream, graph,  # noqa: F401
                              graph_pool_handle, graph_task_group_begin, graph_task_group_end,
                              graph_task_update_begin, graph_task_update_end, stream)

TOTAL_BYTES = 32 << 30
_current = 0


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def manual_seed_all(seed: int) -> None:
    pass


def device_count() -> int:
    return 1


def current_device() -> int:
    return _current


def _index(device: Any = None) -> int:
    idx = getattr(device, "index", device)
    idx = 0 if idx is None else int(idx)
    if idx != 0:
        raise RuntimeError(f"simulated npu: invalid device index {idx} (one device)")
    return idx


def set_device(device: Any) -> None:
    global _current
    _current = _index(device)


def synchronize(device: Any = None) -> None:
    _index(device)  # every simulated op completes on the host before returning


def get_device_name(device: Any = None) -> str:
    _index(device)
    return "Ascend910B (simulated on CPU by pagedllm tests)"


def mem_get_info(device: Any = None) -> tuple[int, int]:
    _index(device)
    return TOTAL_BYTES - _device.MEMORY.allocated, TOTAL_BYTES


def memory_allocated(device: Any = None) -> int:
    _index(device)
    return _device.MEMORY.allocated


def max_memory_allocated(device: Any = None) -> int:
    _index(device)
    return _device.MEMORY.peak


def reset_peak_memory_stats(device: Any = None) -> None:
    _index(device)
    _device.MEMORY.peak = _device.MEMORY.allocated


_device.setup(sys.modules[__name__])
