"""LoopbackConnector: prefill/decode disaggregation between two engines on one host (vLLM's SharedStorageConnector
idea, with the disk tier's block files).

The prefill instance (``kv_role`` ``kv_producer``, or ``kv_both`` for a request that asks with
``{"do_remote_decode": true}``) writes every full prompt block of a request to a shared folder in the step whose
forward completes the prompt (before the response leaves), and its response carries ``kv_transfer_params``: the
block hashes and vLLM's ``remote_*`` fields. The decode instance (``kv_consumer`` / ``kv_both``), given those params
(``do_remote_prefill``), loads the blocks its own prefix cache lacks instead of computing them and deletes the files
it consumed. Files are the disk tier's (``disk_store.DiskStore``: checksummed, atomically renamed, keyed by model
identity and block hash), so a missing, corrupt or truncated file is a load error: core recomputes from it, never
reads wrong K/V. The folder is bounded (``storage_bytes_to_use``) and files nobody consumed expire after ``ttl_s``.

``kv_connector_extra_config``: ``shared_storage_path`` (default ``/dev/shm/pagedllm-kv``), ``storage_bytes_to_use``
(default 4 GiB), ``ttl_s`` (default 120).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from pagedllm.kv_transfer.base import (KVConnectorBase_V1, KVConnectorContext, KVConnectorMetadata,
                                       KVConnectorRole)
from pagedllm.kv_transfer.disk_store import SUFFIX, TMP_SUFFIX, DiskStore, layout_signature

logger = logging.getLogger(__name__)

DEFAULT_PATH = "/dev/shm/pagedllm-kv"
DEFAULT_BYTES = 4 << 30
DEFAULT_TTL_S = 120.0


@dataclass
class LoopbackMetadata(KVConnectorMetadata):
    # request id -> [(block hash, token ids, device block)], in block order
    saves: dict[str, list[tuple]] = field(default_factory=dict)
    loads: dict[str, list[tuple]] = field(default_factory=dict)


def _incoming(request: Any) -> dict:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


class LoopbackConnector(KVConnectorBase_V1):
    def __init__(self, config: Any, role: KVConnectorRole, context: KVConnectorContext):
        super().__init__(config, role, context)
        extra = config.kv_connector_extra_config
        self.path = str(extra.get("shared_storage_path") or DEFAULT_PATH)
        self.max_bytes = int(extra.get("storage_bytes_to_use", DEFAULT_BYTES))
        self.ttl_s = float(extra.get("ttl_s", DEFAULT_TTL_S))
        self.producer = config.kv_role in ("kv_producer", "kv_both")
        self.consumer = config.kv_role in ("kv_consumer", "kv_both")
        self.engine_id = f"{context.model_identity[:16]}-{os.getpid()}"
        self.stats: dict[str, float] = {"disk_hits": 0, "disk_misses": 0, "disk_bytes_loaded": 0,
                                        "disk_bytes_saved": 0, "load_failures": 0, "loaded_tokens": 0,
                                        "saved_blocks": 0, "consumed_files": 0, "expired_files": 0}
        self.last_sweep = 0.0
        if role is KVConnectorRole.SCHEDULER:
            self.store: Optional[DiskStore] = DiskStore(self.path, context.model_identity, self.max_bytes, quiet=True)
            self.meta = LoopbackMetadata()
            self.starts: dict[str, int] = {}  # request id -> first block index it may load
            self.saved: dict[str, list[str]] = {}  # request id -> hashes written for it (its kv_transfer_params)
        else:
            self.store = None
            self.device_caches: list = []
            self.staging: list = []
            self.load_errors: set[int] = set()
            self.step_stats: dict[str, float] = {}

    # ==== scheduler side ======================================================================================
    def _tokens(self, request: Any, i: int) -> tuple[int, ...]:
        bs = self.context.block_size
        return tuple(request.all_token_ids[i * bs:(i + 1) * bs])

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        params = _incoming(request)
        if not self.consumer or not params.get("do_remote_prefill") or not self.store.enabled:
            return 0, False
        offered = set(params.get("block_hashes") or ())
        bs = self.context.block_size
        start = num_computed_tokens // bs
        hashes = self.context.block_hashes(request, (request.num_tokens - 1) // bs * bs)
        n = 0
        for h in hashes[start:]:
            if h.hex() not in offered or not self.store.contains(h):
                break
            n += 1
        if start + n < len(hashes) and offered:
            self.stats["disk_misses"] += 1
        self.starts[request.request_id] = start
        return n * bs, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        start = self.starts.pop(request.request_id, None)
        n = num_external_tokens // self.context.block_size
        if start is None or n == 0:
            return
        hashes = self.context.block_hashes(request, (start + n) * self.context.block_size)
        self.meta.loads[request.request_id] = [(hashes[i], self._tokens(request, i), block_ids[i])
                                               for i in range(start, start + n)]

    def _wants_save(self, request: Any) -> bool:
        if self.context.block_ids is None:
            return False
        if self.consumer and not bool(_incoming(request).get("do_remote_decode")):
            return False  # kv_both saves only what a request asks for (the router's prefill leg)
        return self.producer

    def build_connector_meta(self, scheduler_output: Any) -> LoopbackMetadata:
        bs = self.context.block_size
        for s in getattr(scheduler_output, "scheduled", ()):
            req = s.request
            p = req.num_prompt_tokens
            completes = s.num_computed_tokens < p <= s.num_computed_tokens + s.num_new_tokens
            if not completes or not self._wants_save(req):
                continue
            hashes = self.context.block_hashes(req, (p - 1) // bs * bs)  # what a consumer loads (not the last token)
            ids = self.context.block_ids(req.request_id)
            self.meta.saves[req.request_id] = [(h, self._tokens(req, i), ids[i]) for i, h in enumerate(hashes)
                                               if not self.store.contains(h)]
            self.saved[req.request_id] = [h.hex() for h in hashes]
        meta, self.meta = self.meta, LoopbackMetadata()
        self.starts.clear()
        return meta

    def update_connector_output(self, connector_output: Optional[dict]) -> None:
        for k, v in (connector_output or {}).get("stats", {}).items():
            self.stats[k] = self.stats.get(k, 0) + v

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        hashes = self.saved.pop(request.request_id, None)
        if not hashes:
            return False, None
        # The blocks are in the store already (written in the step that completed the prompt): free them now.
        return False, {"do_remote_prefill": True, "do_remote_decode": False,
                       "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
                       "remote_block_ids": list(block_ids[:len(hashes)]), "remote_host": "127.0.0.1",
                       "remote_port": None, "tp_size": 1, "kv_connector": "LoopbackConnector",
                       "block_hashes": hashes, "num_tokens": len(hashes) * self.context.block_size}

    def get_stats(self) -> dict[str, float]:
        out = dict(self.stats)
        out["pending_transfers"] = len(self.saved)
        return out

    # ==== worker side =========================================================================================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        ctx = self.context
        self.device_caches = list(kv_caches.values())
        self.staging = ctx.allocate_host_kv_cache(replace(ctx.kv_spec, num_blocks=1, device=torch.device("cpu")),
                                                  False)
        if not all(isinstance(t, torch.Tensor) for t in self.staging):
            raise ValueError("LoopbackConnector needs the backend's host KV caches to be tensors")
        self.store = DiskStore(self.path, ctx.model_identity, self.max_bytes, layout_signature(self.staging))

    def _copy(self, src: list, dst: list, s: int, d: int) -> None:
        self.context.swap_kv_blocks(src, dst, torch.tensor([s]), torch.tensor([d]))

    def _stat(self, key: str, value: float) -> None:
        self.step_stats[key] = self.step_stats.get(key, 0) + value

    def _unlink(self, path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except OSError:
            return False

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self.get_connector_metadata()
        self.load_errors = set()
        done: set[str] = set()  # deleted after the step's loads: two requests may load one shared prefix block
        for ops in meta.loads.values():
            failed = False
            for h, tokens, target in ops:
                n = 0 if failed else self.store.read(h, tokens, self.staging)
                if not n:  # missing, corrupt or truncated (read deleted it): recomputed from here
                    self._stat("load_failures", 0 if failed else 1)
                    done.add(self.store.path(h))  # the rest of a broken transfer is nobody's
                    failed = True
                    self.load_errors.add(target)
                    continue
                self._copy(self.staging, self.device_caches, 0, target)
                self._stat("disk_hits", 1)
                self._stat("disk_bytes_loaded", n)
                self._stat("loaded_tokens", len(tokens))
                done.add(self.store.path(h))  # one transfer, one reader
        for path in done:
            self._stat("consumed_files", self._unlink(path))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are synchronous copies

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole blocks are written once the forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self.get_connector_metadata()
        for ops in meta.saves.values():
            for h, tokens, block in ops:
                self._copy(self.device_caches, self.staging, block, 0)
                n = self.store.write(h, tokens, self.staging)
                self._stat("disk_bytes_saved", n)
                self._stat("saved_blocks", 1 if n else 0)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        self._sweep()
        return None, None

    def _sweep(self) -> None:
        """Delete transfer files older than ``ttl_s`` (their consumer never came), and half-written ones a producer
        killed mid-write left, at most every ``ttl_s / 4``."""
        now = time.time()
        if self.store is None or now - self.last_sweep < self.ttl_s / 4:
            return
        self.last_sweep = now
        try:
            subs = [e.path for e in os.scandir(self.store.dir) if e.is_dir()]
        except OSError:
            return
        for sub in subs:
            try:
                entries = list(os.scandir(sub))
            except OSError:
                continue
            for e in entries:
                try:
                    old = now - e.stat().st_mtime > self.ttl_s
                except OSError:
                    continue
                if e.name.endswith((SUFFIX, TMP_SUFFIX)) and old:
                    self._stat("expired_files", self._unlink(e.path))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.load_errors)

    def build_connector_worker_meta(self) -> Optional[dict]:
        out, self.step_stats = {"stats": self.step_stats}, {}
        return out

    def shutdown(self) -> None:
        self.device_caches, self.staging = [], []
