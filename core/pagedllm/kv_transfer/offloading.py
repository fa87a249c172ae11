"""OffloadingConnector: a host-memory tier and a disk tier under the device prefix cache (SGLang's HiCache idea).

A full prefix-cache block that leaves the device pool's free queue for reuse is copied to a bounded host LRU
(``cpu_bytes_to_use``); a block the host LRU drops goes to the disk tier when there is one (``disk_path``,
``disk_bytes_to_use``; without a host tier evicted blocks go straight to disk). A later request whose prefix misses
the device cache is matched block by block against host, then disk, and the hits are copied back into its fresh
blocks: host hits layer by layer inside the forward (``wait_for_layer_load`` of layer i copies layer i's blocks, so
the copies overlap the earlier layers' compute), disk hits through the staging block in ``start_load_kv``. The
scheduler side keeps the index (which hash sits in which host slot, which files exist); the worker side holds the host
caches (the backend's host layout, through its swap hooks) and does the copies and file I/O. A disk block that does
not verify is a load error: core recomputes that request from it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from pagedllm.backend.registry import SwapUnsupported
from pagedllm.kv_transfer.base import (KVConnectorBase_V1, KVConnectorContext, KVConnectorMetadata,
                                       KVConnectorRole)
from pagedllm.kv_transfer.disk_store import DiskStore, layout_signature

logger = logging.getLogger(__name__)

TIERS = ("host", "disk")


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    # In order, before any load: ("d2h", device block, host slot) | ("h2disk", host slot, hash, tokens)
    # | ("d2disk", device block, hash, tokens)
    saves: list[tuple] = field(default_factory=list)
    # request id -> [("host", slot, device block) | ("disk", hash, tokens, device block) | ("missing", device block)]
    loads: dict[str, list[tuple]] = field(default_factory=dict)


class OffloadingConnector(KVConnectorBase_V1):
    def __init__(self, config: Any, role: KVConnectorRole, context: KVConnectorContext):
        super().__init__(config, role, context)
        extra = config.kv_connector_extra_config
        bpb = max(1, context.bytes_per_block)
        self.num_host_blocks = max(0, int(extra.get("cpu_bytes_to_use", 0)) // bpb)
        self.disk_path: Optional[str] = extra.get("disk_path") or None
        self.disk_bytes = int(extra.get("disk_bytes_to_use", 0))
        self.stats: dict[str, float] = {f"{t}_{k}": 0 for t in TIERS
                                        for k in ("hits", "misses", "bytes_loaded", "bytes_saved")}
        self.stats.update(load_failures=0, pending_loads=0, host_blocks=0,
                          host_capacity_blocks=self.num_host_blocks)
        self.disk: Optional[DiskStore] = None
        if role is KVConnectorRole.SCHEDULER:
            self.host: OrderedDict[bytes, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> (slot, tokens)
            self.free_slots = list(range(self.num_host_blocks - 1, -1, -1))
            self.pinned: set[int] = set()  # host slots this step loads from: not reused before the loads ran
            self.pending_disk: dict[bytes, tuple[int, ...]] = {}  # files this step writes
            self.starts: dict[str, int] = {}  # request id -> first block index the connector may load
            self.meta = OffloadMetadata()
            if self.disk_path:
                self.disk = DiskStore(self.disk_path, context.model_identity, self.disk_bytes, quiet=True)
        else:
            self.device_caches: list = []
            self.layer_index: dict[str, int] = {}
            self.host_loads: list[tuple[int, int]] = []  # this step's (host slot, device block): copied per layer
            self.layers_loaded: set[int] = set()
            self.host_caches: list = []
            self.staging: list = []
            self.load_errors: set[int] = set()
            self.step_stats: dict[str, float] = {}  # reported to the scheduler side after each step

    # ==== scheduler side ======================================================================================
    def _disk_has(self, h: bytes) -> bool:
        return h in self.pending_disk or (self.disk is not None and self.disk.contains(h))

    def _where(self, h: bytes, tokens: tuple[int, ...]) -> Optional[str]:
        entry = self.host.get(h)
        if entry is not None and entry[1] == tokens:
            return "host"
        return "disk" if self._disk_has(h) else None

    def _blocks(self, request: Any, num_computed_tokens: int) -> tuple[int, list[bytes]]:
        bs = self.context.block_size
        last = (request.num_tokens - 1) // bs  # leave at least one token to compute
        return num_computed_tokens // bs, self.context.block_hashes(request, last * bs)

    def _tokens(self, request: Any, i: int) -> tuple[int, ...]:
        bs = self.context.block_size
        return tuple(request.all_token_ids[i * bs:(i + 1) * bs])

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        self.starts[request.request_id] = num_computed_tokens // self.context.block_size
        if not self.host and self.disk is None:
            return 0, False
        start, hashes = self._blocks(request, num_computed_tokens)
        n = 0
        for i in range(start, len(hashes)):
            where = self._where(hashes[i], self._tokens(request, i))
            if where is None:
                break
            if where == "host":  # kept for this step: the request's own allocation may evict blocks to host
                self.host.move_to_end(hashes[i])
                self.pinned.add(self.host[hashes[i]][0])
            n += 1
        return n * self.context.block_size, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        start = self.starts.pop(request.request_id, None)
        if start is None:
            return
        n = num_external_tokens // self.context.block_size
        _, hashes = self._blocks(request, start * self.context.block_size)
        ops = []
        for i in range(start, start + n):
            tokens = self._tokens(request, i)
            where = self._where(hashes[i], tokens)  # again: this allocation's evictions may have moved it
            if where == "host":
                slot = self.host[hashes[i]][0]
                self.pinned.add(slot)  # (already, unless a later lookup's eviction moved it)
                ops.append(("host", slot, block_ids[i]))
            elif where == "disk":
                ops.append(("disk", hashes[i], tokens, block_ids[i]))
            else:
                ops.append(("missing", block_ids[i]))
        if ops:
            self.meta.loads[request.request_id] = ops
            self.stats["pending_loads"] += len(ops)
        if start + n < len(hashes):  # the lookup stopped here: a miss in every tier
            self.stats["host_misses"] += self.num_host_blocks > 0
            if self.disk is not None and self.disk.enabled:
                self.stats["disk_misses"] += 1

    def on_block_evicted(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        if block_hash in self.host:
            self.host.move_to_end(block_hash)
            return
        if self.num_host_blocks == 0:
            if self.disk is not None and self.disk.enabled and not self._disk_has(block_hash):
                self.meta.saves.append(("d2disk", block_id, block_hash, token_ids))
                self.pending_disk[block_hash] = token_ids
            return
        slot = self.free_slots.pop() if self.free_slots else self._reuse_slot()
        if slot is None:
            return  # every host slot feeds a load this step: this block is not offloaded
        self.meta.saves.append(("d2h", block_id, slot))
        self.host[block_hash] = (slot, token_ids)

    def _reuse_slot(self) -> Optional[int]:
        """The least recently used host slot no load of this step reads; its block moves down to disk."""
        for h, (slot, tokens) in self.host.items():
            if slot in self.pinned:
                continue
            del self.host[h]
            if self.disk is not None and self.disk.enabled and not self._disk_has(h):
                self.meta.saves.append(("h2disk", slot, h, tokens))
                self.pending_disk[h] = tokens
            return slot
        return None

    def build_connector_meta(self, scheduler_output: Any) -> OffloadMetadata:
        meta, self.meta = self.meta, OffloadMetadata()
        self.pinned.clear()
        self.pending_disk.clear()  # written by the worker before this step's loads
        self.starts.clear()
        self.stats["host_blocks"] = len(self.host)
        return meta

    def update_connector_output(self, connector_output: Optional[dict]) -> None:
        if not connector_output:
            return
        for k, v in connector_output.get("stats", {}).items():
            self.stats[k] = self.stats.get(k, 0) + v
        self.stats["pending_loads"] = 0
        if connector_output.get("disk_off") and self.disk is not None:
            self.disk.enabled = False  # (the worker side warned)
        if connector_output.get("host_off") and self.num_host_blocks:
            self.num_host_blocks, self.free_slots = 0, []
            self.host.clear()

    def get_stats(self) -> dict[str, float]:
        return dict(self.stats)

    # ==== worker side =========================================================================================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        ctx = self.context
        self.device_caches = list(kv_caches.values())
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        def host_spec(n: int) -> Any:
            return replace(ctx.kv_spec, num_blocks=n, device=torch.device("cpu"))
        try:
            if self.num_host_blocks:
                self.host_caches = ctx.allocate_host_kv_cache(host_spec(self.num_host_blocks), ctx.pin_memory)
            if self.disk_path:
                self.staging = ctx.allocate_host_kv_cache(host_spec(1), False)
        except SwapUnsupported as e:  # the backend's layout has no host copy: no tier (every lookup then fails)
            logger.warning("KV offload tiers off: %s", e)
            self.host_caches, self.staging, self.disk_path = [], [], None
        if self.disk_path:
            if not all(isinstance(t, torch.Tensor) for t in self.staging):
                logger.warning("KV offload disk tier off: the backend's host caches are not tensors")
                self.staging = []
            else:
                self.disk = DiskStore(self.disk_path, ctx.model_identity, self.disk_bytes,
                                      layout_signature(self.staging))

    def _copy(self, src: list, dst: list, s: int, d: int) -> None:
        self.context.swap_kv_blocks(src, dst, torch.tensor([s]), torch.tensor([d]))

    def _disk_on(self) -> bool:
        return self.disk is not None and self.disk.enabled and bool(self.staging)

    def _save_disk(self, h: bytes, tokens: tuple) -> None:
        n = self.disk.write(h, tokens, self.staging)
        self._stat("disk_bytes_saved", n)

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        dev, host, st = self.device_caches, self.host_caches, self.staging
        bpb = self.context.bytes_per_block
        for op in connector_metadata.saves:
            if op[0] == "d2h":
                if host:
                    self._copy(dev, host, op[1], op[2])
                    self._stat("host_bytes_saved", bpb)
            elif self._disk_on():  # h2disk / d2disk, through the one-block staging cache
                self._copy(host if op[0] == "h2disk" else dev, st, op[1], 0)
                self._save_disk(op[2], op[3])

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self.get_connector_metadata()
        self.load_errors = set()
        self.host_loads, self.layers_loaded = [], set()
        bpb = self.context.bytes_per_block
        for ops in meta.loads.values():
            failed = False
            for op in ops:
                target = op[-1]
                if failed:
                    self.load_errors.add(target)
                    continue
                if op[0] == "host" and self.host_caches:
                    self.host_loads.append((op[1], target))  # copied in wait_for_layer_load, layer by layer
                    self._stat("host_hits", 1)
                    self._stat("host_bytes_loaded", bpb)
                    continue
                n = (self.disk.read(op[1], op[2], self.staging) if op[0] == "disk" and self._disk_on() else 0)
                if n:
                    self._copy(self.staging, self.device_caches, 0, target)
                    self._stat("disk_hits", 1)
                    self._stat("disk_bytes_loaded", n)
                else:  # missing, corrupted or truncated: core recomputes the request from here
                    failed = True
                    self.load_errors.add(target)
                    self._stat("load_failures", 1)

    def _stat(self, key: str, value: float) -> None:
        self.step_stats[key] = self.step_stats.get(key, 0) + value

    def wait_for_layer_load(self, layer_name: str) -> None:
        """This layer's host hits, one copy call for all of them (disk hits landed in ``start_load_kv``)."""
        i = self.layer_index[layer_name]
        if not self.host_loads or i in self.layers_loaded:
            return
        self.layers_loaded.add(i)
        src, dst = zip(*self.host_loads)
        self.context.swap_kv_blocks([self.host_caches[i]], [self.device_caches[i]], torch.tensor(src),
                                    torch.tensor(dst))

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # this tier saves on eviction (handle_preemptions), not after the forward

    def wait_for_save(self) -> None:
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.load_errors)

    def build_connector_worker_meta(self) -> Optional[dict]:
        out = {"stats": self.step_stats, "disk_off": self.disk is None or not self.disk.enabled,
               "host_off": not self.host_caches}
        self.step_stats = {}
        return out

    def shutdown(self) -> None:
        if self.role is KVConnectorRole.WORKER:
            self.host_caches, self.staging, self.device_caches = [], [], []
