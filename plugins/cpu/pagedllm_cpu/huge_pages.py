"""Weights repacked at load, placed on 2 MB pages where Linux gives them (transparent huge pages, ``MADV_HUGEPAGE``).

Why: a batch-1 decode streams every weight once a token (~1 GB for a 1.7B Q4_K_M), and on 4 KB pages that is a
quarter of a million pages a token, each a TLB miss, with the hardware prefetchers stopping at every page boundary.
On 2 MB pages the 1.7B Q4_K_M's decode ran 1.01-1.04x faster (five runs of alternated pairs in one process, AMD EPYC
Zen 4 and Zen 5, docs/benchmarks.md), for ~0.6 s more at load (the kernel zeroes each huge page on its first write).
The pages only change where the bytes live: the kernels and their results are the same.

Tensors are cut from shared arenas: anonymous private mappings, 2 MB-aligned, advised ``MADV_HUGEPAGE`` before
anything touches them, so their first writes fault in huge pages (where the kernel has THP in "always" or "madvise"
mode and a free 2 MB page; 4 KB pages otherwise, as before). Consecutive tensors share pages, so no tensor's tail
wastes a page; the untouched rest of an arena costs address space only. An arena is unmapped when the last tensor
cut from it is freed (each tensor holds a reference to its mapping).
"""

from __future__ import annotations

import mmap
import threading
from typing import Optional

import torch

HUGE_PAGE = 2 << 20
_ARENA_BYTES = 256 << 20  # a few arenas for a 1-8B model's weights: at most one partly used huge page each
_ALIGN = 64  # a cache line: the kernels' vector loads


class _Arena:
    def __init__(self, nbytes: int) -> None:
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        self.mm = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
        base = torch.frombuffer(self.mm, dtype=torch.uint8, count=1).data_ptr()
        self.start = -base % HUGE_PAGE  # the first 2 MB boundary in the mapping
        self.end = self.start + size
        self.used = self.start
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.mm.madvise(mmap.MADV_HUGEPAGE, self.start, size)

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        off = -(-self.used // _ALIGN) * _ALIGN
        if off + nbytes > self.end:
            return None
        self.used = off + nbytes
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=off)


_lock = threading.Lock()
_arena: Optional[_Arena] = None


def empty_on_huge_pages(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 ``[nbytes]`` tensor in an arena advised for 2 MB pages."""
    global _arena
    with _lock:
        t = _arena.take(nbytes) if _arena is not None else None
        if t is None:
            _arena = _Arena(max(nbytes, _ARENA_BYTES))
            t = _arena.take(nbytes)
    return t

