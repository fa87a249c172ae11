"""Give the C heap's free pages back after a load stage's transient buffers.

Weights are unpacked, dequantized and fused through temporaries that glibc's malloc serves from its heap once its
mmap threshold has adapted upwards (it does after the first large free); freed, they stay resident, wedged between
the packed weights that outlive them, and count towards the process's peak RSS at the next stage. ``malloc_trim``
returns every free page of the heap to the OS (measured: 48 MB after packing SmolLM2's Q4_1 linears).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Optional


@functools.cache
def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; other C libraries lack it (nothing to do there)
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
