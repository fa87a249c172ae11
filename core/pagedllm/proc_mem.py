"""A process's resident memory, read from ``/proc/<pid>/statm`` (Linux): what the grammar compile and render worker
pools watch to replace a worker that has grown too large, and what benchmarks report."""

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
