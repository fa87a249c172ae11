"""Sliding-window KV groups: per-group block tables over one shared pool, freeing blocks that left the window.

vLLM v1's hybrid allocator for models that mix full and sliding-window attention (Gemma 2/3: 5 local layers per
global one; Qwen2 with ``max_window_layers``; GPT-OSS) or slide on every layer (Mistral with a window):

* **Layout** (``kv_cache_utils._get_kv_cache_config_uniform_page_size``): the attention layers are split, by kind,
  into groups of equal size ``group_size``; there are ``group_size`` KV tensors, and layer ``j`` of *every* group
  views tensor ``j``. A block id therefore costs ``group_size`` layers of memory and belongs to one group at a time,
  so a block a sliding group frees returns to the ONE pool and any group may take it next. A group with fewer layers
  than ``group_size`` leaves the last tensors' share of its blocks unused (vLLM's padding).
* **Freeing** (``SlidingWindowManager.remove_skipped_blocks``): the kernels keep keys with ``q_pos - k_pos < W``,
  so once ``num_computed_tokens`` tokens are written no query reads a key before ``num_computed_tokens - W + 1``;
  whole blocks before that are released and their table entries become the null block (``None`` here, block id 0
  in the tables the kernels read: masked out, never an output).
* **Prefix cache** (``HybridKVCacheCoordinator.find_longest_cache_hit``): a full group needs every block of the hit,
  a sliding group only the blocks its window reaches from the hit's end (``ceil((W - 1) / block)`` of them); the
  hit is the longest length every group has, and the earlier blocks of a sliding group are null.

Where every layer is full attention there is no layout (``None``) and ``KVCacheManager`` runs as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pagedllm.sched.kv_manager import KVBlock, KVCacheManager
from pagedllm.sched.request import Request

logger = logging.getLogger(__name__)

#: What the kernels read for a null block-table entry (a freed sliding block): masked out by the window
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV cache group: its model layers (in order) and their window (``None``: full attention)."""

    layers: tuple[int, ...]
    sliding_window: Optional[int] = None


@dataclass(frozen=True)
class KVGroupLayout:
    """The model's KV groups: layer ``layers[j]`` of each group reads and writes KV tensor ``j``."""

    groups: tuple[KVGroupSpec, ...]
    group_size: int  # KV tensors allocated (the layers one block id spans)
    num_layers: int

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def group_of(self, layer: int) -> int:
        return next(g for g, spec in enumerate(self.groups) if layer in spec.layers)

    def tensor_of(self, layer: int) -> int:
        return self.groups[self.group_of(layer)].layers.index(layer)

    def layer_caches(self, tensors: Sequence[Any]) -> list:
        """The per-layer cache list a model reads (``CausalLM.kv_caches``) over the ``group_size`` tensors."""
        if len(tensors) != self.group_size:
            raise ValueError(f"{len(tensors)} KV tensors for a layout of group size {self.group_size}")
        return [tensors[self.tensor_of(i)] for i in range(self.num_layers)]

    def blocks_per_seq(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Block ids one sequence of ``num_tokens`` holds at most, over all groups (a sliding group: its window
        plus the largest chunk a step writes)."""
        full = -(-num_tokens // block_size)
        return sum(full if g.sliding_window is None
                   else min(full, -(-(g.sliding_window - 1 + max_chunk) // block_size) + 1) for g in self.groups)

    def describe(self) -> str:
        kinds = ", ".join(f"{len(g.layers)}x{'full' if g.sliding_window is None else f'window {g.sliding_window}'}"
                          for g in self.groups)
        return f"{self.num_groups} KV groups of up to {self.group_size} layers ({kinds})"


def plan_kv_groups(layer_windows: Sequence[Optional[int]]) -> Optional[KVGroupLayout]:
    """Group the layers by window (vLLM's uniform-page-size rule); ``None`` when every layer is full attention.

    The group size is the smallest kind's layer count, or the largest's when they differ by under 25% (less padding
    than splitting): Gemma-3-1B's 4 global and 22 local layers make 1 full group and 6 sliding groups of 4."""
    if not layer_windows or all(w is None for w in layer_windows):
        return None
    kinds: dict[Optional[int], list[int]] = {}
    for i, w in enumerate(layer_windows):
        kinds.setdefault(w, []).append(i)
    counts = [len(v) for v in kinds.values()]
    lo, hi = min(counts), max(counts)
    size = hi if hi < lo * 1.25 else lo
    # full attention first: its hit bounds every other group's (vLLM's coordinator order)
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    groups = tuple(KVGroupSpec(tuple(kinds[w][i:i + size]), w) for w in order for i in range(0, len(kinds[w]), size))
    return KVGroupLayout(groups, size, len(layer_windows))


def choose_kv_layout(model: Any, config: Any, graph_capture: str, static: bool, has_draft: bool = False,
                     own_runner: bool = False) -> Optional[KVGroupLayout]:
    """The layout the worker allocates, or ``None`` (one table for every layer, nothing freed): models with no
    sliding layer, and every case whose step cannot hand each layer its group's table — said in one log line."""
    windows = getattr(model, "layer_sliding_windows", None)
    layout = plan_kv_groups(windows) if windows else None
    if layout is None:
        return None
    why = None
    if getattr(config, "disable_hybrid_kv_cache_manager", False):
        why = "disable_hybrid_kv_cache_manager is set"
    elif getattr(model, "state_shapes", None):
        why = "the model keeps recurrent state"
    elif getattr(model, "kv_cache_mla", False):
        why = "its cache is MLA's latent"
    elif own_runner:
        why = "the backend runs its own model runner, which reads one block table (kv.block_ids)"
    elif static and not config.enforce_eager:
        why = "the backend runs static batch shapes, whose buffers hold one block table"
    elif graph_capture != "none" and not config.enforce_eager:
        why = f"the backend captures graphs ({graph_capture}), whose buffers hold one block table"
    elif has_draft or config.speculative_config is not None:
        why = "speculative decoding's draft shares the target's block ids"
    elif config.kv_transfer_config is not None:
        why = "a KV connector moves one block table per request"
    elif config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        why = "tensor/pipeline parallel ranks are not grouped yet"
    elif len(getattr(model, "layers", ())) != layout.num_layers or not all(
            hasattr(getattr(layer, "self_attn", None), "kv_group") for layer in model.layers):
        why = "its layers do not read per-group metadata"
    if why is not None:
        logger.info("sliding-window KV blocks are kept (one block table for all layers): %s", why)
        return None
    for i, layer in enumerate(model.layers):
        layer.self_attn.kv_group = layout.group_of(i)
    logger.info("%s; blocks that leave a window return to the pool", layout.describe())
    return layout


class HybridKVCacheManager(KVCacheManager):
    """:class:`KVCacheManager` with one block table per KV group over the same pool (vLLM's
    ``HybridKVCacheCoordinator`` + ``SlidingWindowManager``). Tables hold ``None`` (the null block) where a sliding
    group freed a block or a prefix hit did not need one; every group's table has one entry per block of the
    sequence, so all groups share positions and widths."""

    def __init__(self, num_blocks: int, block_size: int, layout: KVGroupLayout, enable_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_caching)
        self.layout = layout
        self.windows = [g.sliding_window for g in layout.groups]
        self.req_tables: dict[str, list[list[Optional[KVBlock]]]] = {}
        self.num_freed_by_window = 0  # blocks released because they left a window (stats, tests)

    # ---- queries ---------------------------------------------------------------------------------
    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """Each group's block table (null entries as :data:`NULL_BLOCK_ID`)."""
        tables = self.req_tables.get(request_id)
        if tables is None:
            return [[] for _ in self.windows]
        return [[NULL_BLOCK_ID if b is None else b.block_id for b in t] for t in tables]

    def block_ids(self, request_id: str) -> list[int]:
        """Every block the request holds, over all groups (not a table: see :meth:`group_block_ids`)."""
        return [b.block_id for t in self.req_tables.get(request_id, ()) for b in t if b is not None]

    def num_blocks_of(self, request_id: str) -> int:
        return sum(self.num_blocks_of_group(request_id, g) for g in range(len(self.windows)))

    def num_blocks_of_group(self, request_id: str, group: int) -> int:
        tables = self.req_tables.get(request_id)
        return 0 if tables is None else sum(b is not None for b in tables[group])

    # ---- prefix cache ----------------------------------------------------------------------------
    @staticmethod
    def _key(block_hash: bytes, group: int) -> bytes:
        """A block's cache key in one group (vLLM's ``BlockHashWithGroupId``): groups never share K/V."""
        return block_hash + group.to_bytes(2, "little")

    def _lookup(self, req: Request, hashes: list[bytes], i: int, group: int) -> Optional[KVBlock]:
        bs = self.block_size
        return self.pool.lookup(self._key(hashes[i], group), tuple(req.all_token_ids[i * bs:(i + 1) * bs]))

    def _window_hit(self, req: Request, hashes: list[bytes], k: int, group: int, window: int) -> int:
        """Longest hit of at most ``k`` blocks for a sliding group: the ``ceil((W - 1) / block)`` blocks before its
        end cached (or every block from the first), scanning right to left like vLLM."""
        need = -(-(window - 1) // self.block_size)
        run = 0
        for i in range(k - 1, -1, -1):
            if self._lookup(req, hashes, i, group) is None:
                run = 0
                continue
            run += 1
            if run >= need:
                return i + run
        return run  # a run from block 0 (shorter than the window reaches) is a hit too

    def get_computed_blocks(self, req: Request) -> tuple[list, int]:
        """Per-group hit blocks (``None`` for a sliding group's unneeded ones) of the longest prefix every group
        has cached, leaving at least one token to compute."""
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        k = (req.num_tokens - 1) // bs
        hashes = self._block_hashes(req, k * bs)
        for g, w in enumerate(self.windows):
            if w is None:
                n = 0
                while n < k and self._lookup(req, hashes, n, g) is not None:
                    n += 1
                k = n
        while k > 0:  # each sliding group may shorten it; the others must hold at the shorter length too
            k0 = k
            for g, w in enumerate(self.windows):
                if w is not None:
                    k = min(k, self._window_hit(req, hashes, k, g, w))
            if k == k0:
                break
        if k == 0:
            return [], 0
        hits: list[list[Optional[KVBlock]]] = []
        for g, w in enumerate(self.windows):
            first = 0 if w is None else max(0, k * bs - w + 1) // bs
            hits.append([None] * first + [self._lookup(req, hashes, i, g) for i in range(first, k)])
        return hits, k * bs

    # ---- allocation ------------------------------------------------------------------------------
    def _free_skipped(self, tables: list[list[Optional[KVBlock]]], num_computed: int) -> None:
        """Release every sliding group's blocks that lie wholly before ``num_computed - W + 1`` (no query from
        here on reads them), tail-first, replacing them by the null block."""
        for t, w in zip(tables, self.windows):
            if w is None:
                continue
            last = min(max(0, num_computed - w + 1) // self.block_size, len(t))
            dead = []
            for i in range(last - 1, -1, -1):
                if t[i] is None:
                    break  # (everything before was freed by an earlier call)
                dead.append(t[i])
                t[i] = None
            if dead:
                self.pool.release(dead)
                self.num_freed_by_window += len(dead)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: Sequence = (),
                       num_external_tokens: int = 0) -> bool:
        """Free what left each window, then ensure every group's blocks for ``num_computed_tokens +
        num_new_tokens`` tokens; False (and no new blocks) if the pool is short."""
        if num_external_tokens:
            raise RuntimeError("KV groups do not take a KV connector's external tokens")
        rid, bs = req.request_id, self.block_size
        existing = rid in self.req_tables
        tables = self.req_tables[rid] if existing else [[] for _ in self.windows]
        num_hit = len(computed_blocks[0]) * bs if computed_blocks else 0
        num_computed = req.num_computed_tokens + num_hit
        total = num_computed + num_new_tokens
        num_needed = -(-total // bs)
        self._free_skipped(tables, num_computed)
        if existing or not computed_blocks:
            need = sum(max(0, num_needed - len(t)) for t in tables)
            if need == 0 and existing:  # (a decode step usually fits its last block)
                self._publish(req, tables, total)
                return True
            if need > self.pool.num_free:
                return False  # (a new request leaves no entry: it is admitted later, maybe with hits)
        else:
            hit_blocks = [b for h in computed_blocks for b in h if b is not None]
            idle = sum(1 for b in hit_blocks if b.ref_cnt == 0)
            need = sum(num_needed - len(h) for h in computed_blocks)
            if need + idle > self.pool.num_free:
                return False
            self.pool.touch(hit_blocks)
            tables = [list(h) for h in computed_blocks]
        for t in tables:
            if num_needed > len(t):
                t.extend(self.pool.take(num_needed - len(t)))
        self.req_tables[rid] = tables
        self._publish(req, tables, total)
        return True

    def _publish(self, req: Request, tables: list[list[Optional[KVBlock]]], total: int) -> None:
        """Register the blocks that will be full once this step's tokens are written, in every group."""
        if not self.enable_caching:
            return
        bs, rid = self.block_size, req.request_id
        full = min(total, req.num_tokens) // bs
        done = self.req_registered.get(rid, 0)
        if full <= done:
            return
        hashes = self._block_hashes(req, full * bs)
        for i in range(done, full):
            tokens = tuple(req.all_token_ids[i * bs:(i + 1) * bs])
            for g, t in enumerate(tables):
                if t[i] is not None:
                    self.pool.register(t[i], self._key(hashes[i], g), tokens)
        self.req_registered[rid] = full

    def trim(self, req: Request, num_tokens: int) -> None:
        tables = self.req_tables.get(req.request_id)
        keep = -(-num_tokens // self.block_size)
        if tables is None:
            return
        for t in tables:
            if len(t) > keep:
                self.pool.release([b for b in reversed(t[keep:]) if b is not None])
                del t[keep:]

    def forget_from(self, req: Request, index: int) -> None:
        for t in self.req_tables.get(req.request_id, []):
            for block in t[index:]:
                if block is None:
                    continue
                if block.block_hash is not None and self.pool.cached.get(block.block_hash) is block:
                    del self.pool.cached[block.block_hash]
                block.block_hash = block.token_ids = None
        self.req_registered[req.request_id] = min(self.req_registered.get(req.request_id, 0), index)

    def free(self, req: Request) -> None:
        for t in reversed(self.req_tables.pop(req.request_id, [])):
            self.pool.release([b for b in reversed(t) if b is not None])
        self.req_hashes.pop(req.request_id, None)
        self.req_registered.pop(req.request_id, None)
