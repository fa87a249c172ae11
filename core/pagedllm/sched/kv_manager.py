"""Paged KV block accounting: a ref-counted block pool with an LRU free queue and a prefix cache.

Like vLLM v1's ``BlockPool`` + ``KVCacheManager``: a full block is identified by a chained hash of
(parent hash, its token ids, extra keys); freed blocks keep their hash and stay reusable until the free queue hands
them out again (least recently freed first). A hit is verified against the stored tokens, so a hash collision can
only cost a miss, never wrong K/V.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pagedllm.multimodal.inputs import mm_hashes_in
from pagedllm.sched.block_hash import hash_block
from pagedllm.sched.request import Request
from pagedllm.sched.state_slots import StateSlotPool, StateSwapSpace

logger = logging.getLogger(__name__)


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None
        self.token_ids: Optional[tuple[int, ...]] = None  # stored for hit verification

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """All physical blocks; the free queue is an OrderedDict so take-oldest, remove and append are O(1)."""

    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 1:
            raise ValueError(f"num_blocks: the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        # Told of a cached block about to be reused, while its K/V is intact (the KV connector's host/disk tier)
        self.on_evict: Optional[Callable[[KVBlock], None]] = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def take(self, n: int) -> list[KVBlock]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)
            if block.block_hash is not None:  # evict its cached identity
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    if self.on_evict is not None:
                        self.on_evict(block)
                block.block_hash = block.token_ids = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> Optional[KVBlock]:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling idle ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Sequence[KVBlock]) -> None:
        """Drop a reference; callers pass blocks tail-first so a sequence's last blocks are evicted first. A block
        the prefix cache does not hold goes to the front: it is reused before a never-written block, keeping the
        pool's written (resident) pages few; the backends commit a cache page on its first write."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block.block_id] = block
                if block.block_hash is None:
                    self.free.move_to_end(block.block_id, last=False)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"double free of block {block.block_id}")

    def register(self, block: KVBlock, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached.setdefault(block_hash, block)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which served from cache


class KVCacheManager:
    """Per-request block tables on top of a :class:`BlockPool` (the scheduler owns one)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}
        self.req_registered: dict[str, int] = {}  # leading blocks already published to the prefix cache
        self.stats = PrefixCacheStats()
        #: Recurrent-state slots (models with state, ``sched/state_slots.py``), else None
        self.state_slots: Optional[StateSlotPool] = None
        #: Host slots of swapped-out requests' state (``swap_space`` on a model with state), else None
        self.state_swap: Optional[StateSwapSpace] = None
        self.pending_load: set[int] = set()  # blocks a KV connector fills before this step's forward: no hit yet

    def use_state_slots(self, num_slots: int, num_host_slots: int = 0) -> None:
        """Give every running request a recurrent-state slot (taken with its first blocks, freed with them), and turn
        prefix caching off: a cached block's K/V is reusable, but the state after its tokens is not kept (vLLM's
        "align" mode, which snapshots state at block boundaries, is the alternative). ``num_host_slots``: host
        slots for the state of requests preempted by swap (0: swap off). Before any request runs."""
        self.state_slots = StateSlotPool(num_slots)
        self.state_swap = StateSwapSpace(self.state_slots, num_host_slots) if num_host_slots else None
        if self.enable_caching:
            logger.info("prefix caching off: the model keeps recurrent state per request, which the prefix cache "
                        "does not snapshot at block boundaries")
        self.enable_caching = self.pool.enable_caching = False

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache can serve (in use or idle in the free queue)."""
        return self.pool.num_cached

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds now (0 when it holds none)."""
        return len(self.req_blocks.get(request_id, ()))

    # ---- prefix cache ----------------------------------------------------------------------------
    def _block_hashes(self, req: Request, upto: int) -> list[bytes]:
        """Hashes of the full blocks among the request's first ``upto`` tokens (memoized per request)."""
        hashes = self.req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= upto:
            i = len(hashes)
            # The adapter changes every block's K/V: keyed into the first hash, it chains into all later ones.
            extra = (getattr(req, "lora_int_id", 0) or None) if i == 0 else None
            mm = getattr(req, "mm_features", None)
            images = mm_hashes_in(mm, i * bs, (i + 1) * bs) if mm else ()
            if images:  # the pixels behind the block's image tokens: different images never share K/V
                extra = (extra, images)
            hashes.append(hash_block(hashes[-1] if hashes else None, req.all_token_ids[i * bs:(i + 1) * bs], extra))
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens, leaving at least one token to compute (for logits)."""
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_hit = req.num_tokens - 1
        hits: list[KVBlock] = []
        for i, h in enumerate(self._block_hashes(req, max_hit)):
            block = self.pool.lookup(h, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
            if block is None or block.block_id in self.pending_load:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def block_hashes(self, req: Request, upto: int) -> list[bytes]:
        """The prefix-cache keys of the request's full blocks among its first ``upto`` tokens (KV connectors')."""
        return self._block_hashes(req, upto)[:upto // self.block_size]

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count a lookup once, when the request is admitted (a refused admission retries next step)."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit

    # ---- allocation ------------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = (),
                       num_external_tokens: int = 0) -> bool:
        """Ensure blocks for ``num_computed_tokens + num_new_tokens`` tokens; False (and no change) if short.
        ``num_external_tokens`` (whole blocks after the cache hits) get fresh blocks a KV connector loads."""
        rid, bs = req.request_id, self.block_size
        blocks = self.req_blocks.get(rid, [])
        num_computed = req.num_computed_tokens + len(computed_blocks) * bs + num_external_tokens
        total = num_computed + num_new_tokens
        need = -(-total // bs) - len(blocks) - len(computed_blocks)
        slots = self.state_slots
        new_slot = slots is not None and not slots.has_slot(rid)  # a stateful request starts: it needs a slot too
        if new_slot and slots.num_free == 0:
            return False
        if need > 0 or computed_blocks:  # (a decode step usually fits its last block: skip all of this)
            idle_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # these leave the free queue too
            if need + idle_hits > self.pool.num_free:
                return False
            if computed_blocks:
                self.pool.touch(computed_blocks)
                blocks = blocks + list(computed_blocks)
            if need > 0:
                blocks = blocks + self.pool.take(need)
        if num_external_tokens:
            first = len(computed_blocks) + req.num_computed_tokens // bs
            self.pending_load.update(b.block_id for b in blocks[first:first + num_external_tokens // bs])
        self.req_blocks[rid] = blocks
        if new_slot:
            slots.take(rid)
        if self.enable_caching:  # publish blocks that will be full once this step's tokens are written
            full = min(total, req.num_tokens) // bs
            done = self.req_registered.get(rid, 0)
            if full > done:
                hashes = self._block_hashes(req, full * bs)
                for i in range(done, full):
                    self.pool.register(blocks[i], hashes[i], tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
                self.req_registered[rid] = full
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the request's trailing blocks beyond the first ``num_tokens`` tokens (rejected speculative
        lookahead). Only unpublished blocks can be trailing: published ones hold accepted tokens."""
        blocks = self.req_blocks.get(req.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        assert keep >= self.req_registered.get(req.request_id, 0), "trim would drop a published block"
        self.pool.release(list(reversed(blocks[keep:])))
        del blocks[keep:]

    def forget_from(self, req: Request, index: int) -> None:
        """The request's blocks from ``index`` on hold no valid K/V (a KV connector's load failed): drop them from the
        prefix cache; they are published again once recomputed."""
        for block in self.req_blocks.get(req.request_id, [])[index:]:
            if block.block_hash is not None and self.pool.cached.get(block.block_hash) is block:
                del self.pool.cached[block.block_hash]
            block.block_hash = block.token_ids = None
        self.req_registered[req.request_id] = min(self.req_registered.get(req.request_id, 0), index)

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self.pool.release(list(reversed(blocks)))
        self.req_hashes.pop(req.request_id, None)
        self.req_registered.pop(req.request_id, None)
        if self.state_slots is not None:
            self.state_slots.free(req.request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block identity; only possible when no block is in use (like vLLM's)."""
        if self.num_used_blocks:
            return False
        # all free and about to be empty: the cached (written) ones go first, the last released at the very front
        for block in [b for b in self.pool.free.values() if b.block_hash is not None]:
            self.pool.free.move_to_end(block.block_id, last=False)
        for block in self.pool.blocks:
            block.block_hash = block.token_ids = None
        self.pool.cached.clear()
        return True
