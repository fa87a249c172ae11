"""A process's resident memory, read from ``/proc/<pid>/statm`` and ``status`` (Linux): what the grammar compile and
render worker pools watch to replace a worker that has grown too large, and what benchmarks report."""

from __future__ import annotations

import os
from typing import Optional, Union


def rss_bytes(pid: Union[int, str] = "self") -> Optional[int]:
    """Resident bytes of ``pid`` (default: this process); None where /proc is not there or the process is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes(pid: Union[int, str] = "self") -> Optional[int]:
    """Peak resident bytes of ``pid``'s own address space (``VmHWM``); None where /proc is not there or the process
    is gone (or a zombie).

    Why not ``wait4``'s ``ru_maxrss`` for a child: on Linux, exec folds the peak of the address space it replaces
    into that figure, and a child started by ``subprocess`` (vfork) replaces its parent's, so it reads at least the
    parent's own peak."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
