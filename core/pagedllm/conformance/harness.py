"""What every conformance check uses: its context (backend, dtype, tolerances, seeded RNG), comparison against the
reference with NaN poisoning, and random paged batches."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.registry import Backend


class CheckFailed(AssertionError):
    """The backend's result disagrees with the reference."""


class Untested(Exception):
    """The check cannot run here (feature not declared, dependency missing); the reason goes in the report."""


class NotApplicable(Untested):
    """The backend does not offer what the case checks, by a choice the contract allows (e.g. no host swap: core
    preempts by recompute). Reported not applicable with the reason: never a failure, never a testing gap."""


@dataclass
class CaseContext:
    backend: Backend
    device: torch.device
    dtype: torch.dtype
    params: dict
    atol: float
    rtol: float
    seed: int
    max_abs_err: float = 0.0
    notes: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed)

    def randn(self, *shape: int, dtype: Optional[torch.dtype] = None, scale: float = 1.0) -> torch.Tensor:
        """Random normal on the host (device-independent stream), then moved: same inputs on every backend."""
        x = torch.randn(*shape, generator=self.gen) * scale
        return x.to(device=self.device, dtype=dtype or self.dtype)

    def randint(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(high, shape, generator=self.gen).to(self.device)

    def randperm(self, n: int) -> list[int]:
        return torch.randperm(n, generator=self.gen).tolist()

    def compare(self, out: Any, ref: torch.Tensor, what: str, exact: bool = False,
                where: Optional[Callable[[tuple], str]] = None) -> None:
        """Raise :class:`CheckFailed` unless ``out`` matches ``ref`` (NaN where ref is NaN, nowhere else).

        ``where`` turns the index of the first bad element into words (sequence, position, block, head)."""
        if not isinstance(out, torch.Tensor):
            raise CheckFailed(f"{what}: expected a tensor, got {type(out).__name__}")
        if tuple(out.shape) != tuple(ref.shape):
            raise CheckFailed(f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
        if out.dtype != ref.dtype:
            raise CheckFailed(f"{what}: dtype {out.dtype} != reference {ref.dtype}")
        o, r = out.detach().float().cpu(), ref.detach().float().cpu()
        o_nan, r_nan = o.isnan(), r.isnan()
        if not torch.equal(o_nan, r_nan):
            extra, missing = int((o_nan & ~r_nan).sum()), int((r_nan & ~o_nan).sum())
            first = tuple(int(i) for i in (o_nan != r_nan).nonzero()[0])
            raise CheckFailed(f"{what}: {extra} NaN element(s) where the reference has values (read of a poisoned "
                              f"slot or an unwritten output?), {missing} value(s) where the reference is NaN "
                              f"(write outside the expected slots?); first at {first}"
                              + (f" ({where(first)})" if where else ""))
        diff = (o - r).abs().nan_to_num(0.0)
        err = float(diff.max()) if diff.numel() else 0.0
        self.max_abs_err = max(self.max_abs_err, err)
        atol, rtol = (0.0, 0.0) if exact else (self.atol, self.rtol)
        bad = diff > atol + rtol * r.abs().nan_to_num(0.0)
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise CheckFailed(f"{what}: {int(bad.sum())}/{bad.numel()} element(s) outside atol={atol} rtol={rtol}; "
                              f"max abs err {err:.3g}; first at {idx}"
                              + (f" ({where(idx)})" if where else "")
                              + f": got {float(o[idx]):.6g}, want {float(r[idx]):.6g}")


def case_seed(seed: int, case_id: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(case_id.encode())) % (2**31)


def poison(obj: Any) -> bool:
    """Fill every floating tensor in ``obj`` (a tensor or list/tuple of them) with NaN; False if nothing was."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            obj.fill_(float("nan"))
            return True
        return False
    if isinstance(obj, (list, tuple)):
        return all([poison(x) for x in obj]) and len(obj) > 0
    return False


def poison_allocator(numel: int, dtype: torch.dtype, device: torch.device) -> None:
    """Leave NaN-filled memory in the allocator's free list, so an output allocated next with ``empty`` and not fully
    written shows NaN. Best effort (exact on torch's caching GPU allocators; usually so on the host for small
    sizes)."""
    x = torch.full((max(numel, 1),), float("nan"), dtype=dtype, device=device)
    del x


@dataclass
class PagedBatch:
    """A flat batch over randomly placed physical blocks, plus slots covering every context token."""

    meta: AttentionMetadata
    num_blocks: int
    context_slots: torch.Tensor  # int64 [sum(seq_lens)]: the slot of every token of every sequence, in order


def make_batch(ctx: CaseContext, query_lens: list[int], seq_lens: list[int], block_size: int,
               spare_blocks: int = 3) -> PagedBatch:
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    perm = ctx.randperm(num_blocks)
    tables, k = [], 0
    for n in needed:
        tables.append(perm[k:k + n])
        k += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=ctx.device)
    slots = [bt[p // block_size] * block_size + p % block_size for bt, s in zip(tables, seq_lens) for p in range(s)]
    return PagedBatch(meta, num_blocks, torch.tensor(slots, dtype=torch.int64, device=ctx.device))


def canonical_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A NaN-poisoned cache in the canonical layout, for the reference side."""
    return torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype, device=device)


def token_locator(meta: AttentionMetadata, head_size: int) -> Callable[[tuple], str]:
    """For outputs with one row per query token (``[T, heads, head_size]`` or ``[T, heads * head_size]``): the
    sequence, position, logical block (and physical block) and head of an element index."""
    qsl = [int(x) for x in meta.query_start_loc.cpu().tolist()]
    seq_lens = [int(x) for x in meta.seq_lens.cpu().tolist()]
    tables = meta.block_tables.cpu()
    bs = meta.block_size

    def where(idx: tuple) -> str:
        t = idx[0]
        head = idx[1] if len(idx) >= 3 else (idx[1] // head_size if len(idx) == 2 else 0)
        for i in range(len(seq_lens)):
            if qsl[i] <= t < qsl[i + 1]:
                pos = seq_lens[i] - (qsl[i + 1] - qsl[i]) + (t - qsl[i])
                blk = pos // bs
                phys = int(tables[i, blk]) if blk < tables.shape[1] else -1
                return f"sequence {i}, position {pos}, block {blk} (physical {phys}), offset {pos % bs}, head {head}"
        return f"padding token {t}, head {head}"

    return where


def cache_locator(idx: tuple) -> str:
    """For canonical caches ``[2, num_blocks, block_size, heads, head_size]``."""
    if len(idx) != 5:
        return f"index {idx}"
    kv, blk, off, head, _ = idx
    return f"{'value' if kv else 'key'} cache, physical block {blk}, offset {off}, head {head}"


def slot_locator(slots: torch.Tensor, block_size: int) -> Callable[[tuple], str]:
    """For a canonical cache written at ``slots`` (one per input token, -1 skipped): which input token, block,
    offset and head an element index of the cache is."""
    owner = {int(x): t for t, x in enumerate(slots.cpu().tolist()) if int(x) >= 0}

    def where(idx: tuple) -> str:
        if len(idx) != 5:
            return f"index {idx}"
        kv, blk, off, head, _ = idx
        slot = blk * block_size + off
        tok = f"input token {owner[slot]}" if slot in owner else "no input token (a slot that must stay unwritten)"
        return f"{'value' if kv else 'key'} cache, slot {slot} = block {blk} offset {off}, head {head}: {tok}"

    return where
