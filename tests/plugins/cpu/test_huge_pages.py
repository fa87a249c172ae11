"""The CPU backend's arenas for repacked weights (``huge_pages.py``): bytes equal to the copy's, cache-line aligned,
consecutive tensors packed into one mapping that lives as long as any of them, and, where Linux has transparent huge
pages on, the written bytes backed by 2 MB pages."""

import gc
from pathlib import Path

import torch
from pagedllm_cpu import huge_pages


def _vma_anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _copy(t: torch.Tensor) -> torch.Tensor:
    out = huge_pages.empty_on_huge_pages(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
    return out.copy_(t)


def test_copies_are_equal_aligned_and_share_an_arena():
    src = [torch.randn(37, 11), torch.arange(1000, dtype=torch.int16).reshape(10, 100), torch.randint(0, 255, (77,),
                                                                                                      dtype=torch.uint8)]
    out = [_copy(t) for t in src]
    for s, o in zip(src, out):
        assert o.dtype == s.dtype and o.shape == s.shape and o.is_contiguous() and torch.equal(o, s)
        assert o.data_ptr() % 64 == 0
    # consecutive small tensors are cut one after another from the same mapping (no page each)
    assert 0 < out[1].data_ptr() - out[0].data_ptr() < 4096
    assert 0 < out[2].data_ptr() - out[1].data_ptr() < 4096


def test_a_tensor_outlives_the_arena_it_was_cut_from():
    big = huge_pages.empty_on_huge_pages(huge_pages._ARENA_BYTES + 1)  # its own arena, larger than the default
    assert big.numel() == huge_pages._ARENA_BYTES + 1 and big.dtype == torch.uint8
    kept = _copy(torch.full((4096,), 7, dtype=torch.uint8))
    del big
    huge_pages._arena = None  # the module lets go of its arena: only the tensor holds the mapping now
    gc.collect()
    assert int(kept.sum()) == 7 * 4096  # still mapped and readable


def test_written_weights_sit_on_2mb_pages_where_linux_has_thp_on():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    t = huge_pages.empty_on_huge_pages(8 << 20)
    t.fill_(1)
    huge_kb = _vma_anon_huge_kb(t.data_ptr())
    if "[never]" in mode:  # THP off: 4 KB pages, as without the arenas
        assert huge_kb == 0
    else:  # "always" or "madvise": the arena was advised MADV_HUGEPAGE before its first write
        assert huge_kb >= 2048, (mode, huge_kb)
