"""Host facts for probe and memory sizing: CPU model, SIMD features, RAM. Linux /proc first, portable fallbacks."""

from __future__ import annotations

import os
import platform as _platform
from functools import lru_cache

#: ISA features worth naming, best first (they decide which torch/oneDNN kernels run).
_ISA_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "neon", "asimd", "sve")


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """First processor's ``key: value`` pairs from /proc/cpuinfo ({} where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if info:
                        break
                    continue
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_model() -> str:
    info = _cpuinfo()
    return info.get("model name") or info.get("Processor") or _platform.processor() or _platform.machine() or "cpu"


def cpu_flags() -> frozenset[str]:
    """Every feature flag the first processor reports in /proc/cpuinfo (x86 ``flags``, Arm ``Features``); empty
    where there is no /proc."""
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def isa_features() -> list[str]:
    """The notable SIMD features this CPU reports, in :data:`_ISA_FLAGS` order."""
    flags = cpu_flags()
    found = [f for f in _ISA_FLAGS if f in flags]
    if not found:  # no /proc (macOS, Windows): ask torch what kernels it dispatches to
        try:
            import torch

            found = [torch.backends.cpu.get_cpu_capability().lower()]
        except Exception:
            pass
    return found


def device_name() -> str:
    feats = isa_features()
    cores = os.cpu_count() or 1
    return f"{cpu_model()} ({cores} cpus{', ' + ' '.join(feats) if feats else ''})"


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where there is none)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) -> None


def _cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage) of this process's memory cgroup (v2, then v1), or None when unlimited: in a container
    /proc/meminfo shows the host's RAM, not what we may use."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit = _read_int(limit_path)
        if limit is not None and limit < (1 << 60):
            return limit, _read_int(usage_path) or 0
    return None


def memory_bytes() -> tuple[int, int]:
    """(total, available) host RAM in bytes; available counts reclaimable page cache, as the kernel estimates it,
    and both are capped by a container's memory cgroup limit."""
    mi = _meminfo()
    if "MemTotal" in mi:
        total, avail = mi["MemTotal"], mi.get("MemAvailable", mi.get("MemFree", 0))
    else:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            total, avail = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
        except (ValueError, OSError, AttributeError):
            return 0, 0
    cg = _cgroup_limit()
    if cg is not None:
        limit, usage = cg
        total, avail = min(total, limit), max(0, min(avail, limit - usage))
    return total, avail
