"""Evidence that a run happened on the backend's real device, required before a report says verified-on-hardware.

A simulated device layer run without ``--simulated`` must not pass for hardware. Evidence, all of it generic: the
backend's probe does not describe a simulation or a fake device; for a device type other than ``cpu``, torch's device
module for it is available with at least one device and is not marked as a simulation (``__pagedllm_simulation__``, the
marker of the project's test simulations); and the caches the backend allocates live on that device type. Without it
the report is not verified, with the reason.
"""

from __future__ import annotations

import sys

import torch

from pagedllm.backend.hookspec import KVCacheSpec
from pagedllm.backend.registry import Backend

#: Words in a probe's device name or reason that say the device is not real.
SIMULATION_WORDS = ("simulat", "fake", "emulat")


def _tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for x in obj for t in _tensors(x)] if isinstance(obj, (list, tuple)) else []


def device_evidence(backend: Backend) -> tuple[bool, str]:
    """``(real, words)``: whether the run may be labelled verified-on-hardware, and what showed it (or why not)."""
    probe, dev = backend.probe, backend.device()
    said = f"{probe.device_name} {probe.reason}".lower()
    if any(w in said for w in SIMULATION_WORDS):
        return False, f"the backend's probe describes a simulated device ({probe.device_name or probe.reason!r})"
    if dev.type == "cpu":
        seen = f"host CPU ({probe.device_name or 'unnamed'})"
    else:
        try:
            mod = torch.get_device_module(dev.type)
            count = int(mod.device_count()) if mod.is_available() else 0
        except Exception as e:  # no such device module, or it cannot answer
            return False, f"torch cannot see a {dev.type!r} device ({type(e).__name__}: {e})"
        if count < 1:
            return False, f"torch reports no available {dev.type!r} device"
        package = sys.modules.get(getattr(mod, "__name__", "").split(".")[0])
        if getattr(mod, "__pagedllm_simulation__", False) or getattr(package, "__pagedllm_simulation__", False):
            return False, f"torch's {dev.type!r} device module is marked as a simulation"
        name = getattr(mod, "get_device_name", lambda *_: "")(0) if hasattr(mod, "get_device_name") else ""
        seen = f"torch.{dev.type}: {count} device(s){', ' + name if name else ''}"
    caps = backend.capabilities
    spec = KVCacheSpec(1, 2, caps.block_sizes[0], 1, (caps.head_sizes or (64,))[0],
                       {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(caps.dtypes[0], torch.float32), dev)
    try:
        where = {t.device.type for c in backend.allocate_kv_cache(spec) for t in _tensors(c)}
    except Exception as e:
        return False, f"{seen}, but allocating a KV cache there failed ({type(e).__name__}: {e})"
    if where - {dev.type}:
        return False, f"{seen}, but the backend's caches live on {sorted(where)}, not {dev.type!r}"
    return True, seen
