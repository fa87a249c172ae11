"""The engine's side of a connector: both halves built, called in the contract's order each step, a failed load
turned into a recompute, and blocks a connector keeps after a request finished freed when it reports them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any, Optional

from pagedllm.errors import ParamError
from pagedllm.kv_transfer.base import KVConnectorBase_V1, KVConnectorContext, KVConnectorRole
from pagedllm.kv_transfer.config import OFFLOADING_CONNECTOR, KVTransferConfig
from pagedllm.kv_transfer.factory import connector_class

logger = logging.getLogger(__name__)

#: Seconds a finished request's blocks wait for its connector's ``get_finished`` before core frees them anyway.
DELAY_FREE_TIMEOUT_S = 60.0


def model_identity(model_path: str, config: Any, kv_dtype: Any) -> str:
    """Digest of what makes a block's K/V what it is: the checkpoint (its config and weight files' names, sizes and
    mtimes), dtype, KV dtype, block size and quantization."""
    files = []
    root = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name.endswith((".json", ".safetensors", ".gguf", ".bin")):
            st = os.stat(os.path.join(root, name))
            files.append([name, st.st_size, st.st_mtime_ns])
    key = {"format": 1, "model": os.path.realpath(model_path), "files": files, "dtype": config.dtype,
           "kv_dtype": str(kv_dtype), "block_size": config.block_size, "quantization": config.quantization}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def build_kv_transfer(config: Any, worker: Any, kv: Any, scheduler: Any, backend: Any,
                      model_path: str) -> Optional["KVTransfer"]:
    """The engine's connector runtime, or None when no connector is configured."""
    tc: Optional[KVTransferConfig] = config.kv_transfer_config
    if tc is None:
        return None
    field = "kv_offload_gib" if (config.kv_offload_gib or config.kv_offload_dir) else "kv_transfer_config"
    if not worker.requires_kv_cache:
        raise ParamError(field, "the model keeps no KV cache (encoder-only): nothing to transfer")
    if getattr(worker, "state_spec", None) is not None:
        raise ParamError(field, f"{worker.info.architecture} keeps recurrent state per request, which a connector's "
                                "blocks do not carry (only K/V): serve it without one")
    if config.speculative_config is not None:
        raise ParamError(field, "is not supported with speculative decoding yet (the draft's K/V shares the blocks)")
    if tc.kv_connector == OFFLOADING_CONNECTOR and not config.enable_prefix_caching:
        raise ParamError(field, "the offload tiers sit under the prefix cache: enable_prefix_caching must be on")
    cls = connector_class(tc.kv_connector)
    names = [f"model.layers.{i}.self_attn" for i in range(len(worker.kv_caches))]
    ctx = KVConnectorContext(
        model_identity=model_identity(model_path, config, worker.kv_dtype), block_size=kv.block_size,
        num_device_blocks=kv.num_blocks, bytes_per_block=worker.kv_spec.bytes_per_block, kv_spec=worker.kv_spec,
        layer_names=names, block_hashes=kv.block_hashes, block_ids=kv.block_ids,
        allocate_host_kv_cache=backend.allocate_host_kv_cache,
        swap_kv_blocks=backend.swap_kv_blocks, gather_kv_blocks=backend.gather_kv_blocks,
        pin_memory=backend.memory_info(worker.device).pinned_host)
    rt = KVTransfer(cls(tc, KVConnectorRole.SCHEDULER, ctx), cls(tc, KVConnectorRole.WORKER, ctx), kv,
                    dict(zip(names, worker.kv_caches)))
    rt.worker_side.register_kv_caches(rt.caches)
    scheduler.connector = rt
    kv.pool.on_evict = rt.on_evict
    return rt


class KVTransfer:
    """What the scheduler calls (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
    ``request_finished``) and what the engine calls around each step (``before_forward``, ``after_forward``)."""

    def __init__(self, scheduler_side: KVConnectorBase_V1, worker_side: KVConnectorBase_V1, kv: Any,
                 caches: dict[str, Any]):
        self.scheduler_side, self.worker_side = scheduler_side, worker_side
        self.kv = kv
        self.caches = caches  # layer name -> device cache
        self.layer_names = list(caches)
        self.finished_ids: set[str] = set()
        self.delayed: dict[str, tuple[Any, float]] = {}  # request id -> (request, finish time): blocks kept
        self.num_recomputes = 0  # requests recomputed from a failed load
        self.num_load_errors = 0  # blocks that did not load

    # ---- scheduler -------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """The connector's answer, checked: whole blocks, at least one token left to compute."""
        n, load_async = self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)
        bs = self.kv.block_size
        room = (request.num_tokens - 1 - num_computed_tokens) // bs * bs
        if not n or load_async:
            return 0
        return max(0, min(n // bs * bs, room))

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, block_ids, num_external_tokens)

    def on_evict(self, block: Any) -> None:
        self.scheduler_side.on_block_evicted(block.block_id, block.block_hash, block.token_ids)

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        """True: the connector keeps the blocks (freed once ``get_finished`` reports the request)."""
        self.finished_ids.add(request.request_id)
        delay, params = self.scheduler_side.request_finished(request, block_ids)
        request.kv_transfer_params = params
        if delay:
            self.delayed[request.request_id] = (request, time.monotonic())
        return bool(delay)

    def has_pending(self) -> bool:
        return bool(self.delayed)

    # ---- the step --------------------------------------------------------------------------------------------
    def before_forward(self, sched: Any) -> None:
        """Saves of evicted blocks, then this step's loads; a request whose load failed is recomputed from its first
        failed block. A step with nothing to run completes here (saves, ``get_finished``)."""
        self._poll_finished()
        meta = self.scheduler_side.build_connector_meta(sched)
        w = self.worker_side
        w.bind_connector_metadata(meta)
        try:
            w.handle_preemptions(meta)
            w.start_load_kv()
            for name in self.layer_names:
                w.wait_for_layer_load(name)
            failed = set(w.get_block_ids_with_load_errors())
        except Exception as e:  # noqa: BLE001 - a connector's failure costs a recompute, never the engine
            failed = set(self.kv.pending_load)
            if failed:
                logger.warning("KV connector %s: loading failed (%s: %s); recomputing this step's loads",
                               type(w).__name__, type(e).__name__, e)
        if failed:
            self._recompute(sched, failed)
        self.kv.pending_load.clear()
        self.scheduler_side.update_connector_output(w.build_connector_worker_meta())
        if not sched.scheduled:
            self.after_forward(sched)

    def after_forward(self, sched: Any) -> None:
        w = self.worker_side
        try:
            for name, cache in self.caches.items():
                w.save_kv_layer(name, cache, None, scheduled=sched.scheduled)
            w.wait_for_save()
        except Exception:  # noqa: BLE001 - a failed save is a later miss
            logger.exception("KV connector %s: saving failed", type(w).__name__)
        w.clear_connector_metadata()
        self._poll_finished()

    def _recompute(self, sched: Any, failed: set[int]) -> None:
        bs = self.kv.block_size
        self.num_load_errors += len(failed)
        for s in sched.scheduled:
            req = s.request
            ids = self.kv.block_ids(req.request_id)
            bad = next((j for j, b in enumerate(ids) if b in failed and j * bs < s.num_computed_tokens), None)
            if bad is None:
                continue
            valid = bad * bs
            logger.warning("request %s: %d KV blocks did not load; recomputing from token %d", req.request_id,
                           -(-(s.num_computed_tokens - valid) // bs), valid)
            self.kv.forget_from(req, bad)
            s.num_computed_tokens = req.num_computed_tokens = valid
            s.num_new_tokens = min(s.num_new_tokens, req.num_tokens - valid)  # same budget, earlier tokens
            s.samples = valid + s.num_new_tokens >= req.num_tokens
            req.num_cached_tokens = min(req.num_cached_tokens, valid)
            self.num_recomputes += 1

    def _poll_finished(self) -> None:
        ids, self.finished_ids = self.finished_ids, set()
        try:
            sending, _ = self.worker_side.get_finished(ids)
        except Exception:  # noqa: BLE001
            logger.exception("KV connector %s: get_finished failed", type(self.worker_side).__name__)
            sending = None
        for rid in sending or ():
            entry = self.delayed.pop(rid, None)
            if entry is not None:
                self.kv.free(entry[0])
        now = time.monotonic()
        for rid, (req, t) in list(self.delayed.items()):
            if now - t > DELAY_FREE_TIMEOUT_S:
                logger.warning("KV connector: request %s's transfer did not finish in %.0fs; freeing its blocks",
                               rid, DELAY_FREE_TIMEOUT_S)
                del self.delayed[rid]
                self.kv.free(req)

    # ---- stats, end ------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        out = dict(self.scheduler_side.get_stats())
        out.update(recomputes=self.num_recomputes, load_errors=self.num_load_errors, delayed_frees=len(self.delayed))
        return out

    def shutdown(self) -> None:
        for rid, (req, _) in list(self.delayed.items()):
            self.kv.free(req)
        self.delayed.clear()
        for side in (self.worker_side, self.scheduler_side):
            try:
                side.shutdown()
            except Exception:  # noqa: BLE001
                logger.exception("KV connector shutdown failed")
