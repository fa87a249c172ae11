"""The engine's side of a connector: both halves built, called in the contract's order each step, a failed load
turned into a recompute, and blocks a connector keeps after a request finished freed when it reports them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any, Callable, Optional

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
                    dict(zip(names, worker.kv_caches)), runner=lambda: layerwise_runner(config, worker))
    rt.worker_side.register_kv_caches(rt.caches)
    scheduler.connector = rt
    kv.pool.on_evict = rt.on_evict
    return rt


def layerwise_runner(config: Any, worker: Any) -> Any:
    """The worker's model runner when its steps call the connector per layer (eager, core's runner, one rank),
    else None, logged once: the connector then gets the whole-model calls."""
    runner = getattr(worker, "runner", None)
    level = getattr(worker, "graph_level", "none")
    why = ("the backend runs its own model runner" if not hasattr(runner, "kv_connector")
           else f"steps replay captured graphs ({level})" if level != "none"
           else "steps run on several ranks" if config.tensor_parallel_size * config.pipeline_parallel_size > 1
           else None)
    if why is None:
        return runner
    logger.info("KV connector: %s, so its loads are waited for before each forward and its saves made after it "
                "(not per layer)", why)
    return None


class LayerwiseStep:
    """One step's per-layer connector calls (:class:`pagedllm.backend.attention.KVLayerHooks`), handed to the model
    in ``AttentionMetadata.kv_connector``: the layer is named by its cache, as ``register_kv_caches`` got it. It
    records which layers waited and saved, so the runtime knows after the forward whether every layer read its cache
    after its loads landed; a connector's exception is kept for the runtime, never raised into the forward."""

    def __init__(self, worker_side: KVConnectorBase_V1, names: dict[int, str], scheduled: list):
        self.worker_side = worker_side
        self.names = names  # id(device cache) -> layer name
        self.scheduled = scheduled
        self.waited: list[str] = []
        self.saved: list[str] = []
        self.load_error: Optional[BaseException] = None  # a wait_for_layer_load raised: this step's loads failed
        self.save_error: Optional[BaseException] = None  # a save_kv_layer raised: no more saves this step

    def wait_for_layer_load(self, kv_cache: Any) -> None:
        name = self.names.get(id(kv_cache))
        if name is None:  # not a registered cache: its layer never counts as waited (the step's loads then fail)
            return
        self.waited.append(name)
        if self.load_error is None:
            try:
                self.worker_side.wait_for_layer_load(name)
            except Exception as e:  # noqa: BLE001 - a connector's failure costs a recompute, never the forward
                self.load_error = e

    def save_kv_layer(self, kv_cache: Any, meta: Any) -> None:
        name = self.names.get(id(kv_cache))
        if name is None:
            return
        self.saved.append(name)
        if self.save_error is None:
            try:
                self.worker_side.save_kv_layer(name, kv_cache, meta, scheduled=self.scheduled)
            except Exception as e:  # noqa: BLE001 - a failed save is a later miss
                self.save_error = e


class KVTransfer:
    """What the scheduler calls (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
    ``request_finished``) and what the engine calls around each step (``before_forward``, ``after_forward``).

    Where the step runs the model eagerly through core's model runner, the connector's ``wait_for_layer_load`` and
    ``save_kv_layer`` run inside the forward, per attention layer (:class:`LayerwiseStep`), so loads overlap compute;
    captured graphs (static buckets, decode graphs), a backend's own model runner and tensor/pipeline parallel steps
    get the whole-model calls: every wait before the forward, every save after it. Either way load errors are
    collected after the forward, where the affected requests' step is discarded and rolled back."""

    def __init__(self, scheduler_side: KVConnectorBase_V1, worker_side: KVConnectorBase_V1, kv: Any,
                 caches: dict[str, Any], runner: Optional[Callable[[], Any]] = None):
        self.scheduler_side, self.worker_side = scheduler_side, worker_side
        self.kv = kv
        self.caches = caches  # layer name -> device cache
        self.layer_names = list(caches)
        self.cache_names = {id(c): name for name, c in caches.items()}
        # () -> the model runner that takes a LayerwiseStep (its ``kv_connector``), or None: whole-model calls
        self.runner = runner or (lambda: None)
        self.layerwise: Optional[Any] = None  # the runner, once known to run per layer; False: whole-model
        self.finished_ids: set[str] = set()
        self.delayed: dict[str, tuple[Any, float]] = {}  # request id -> (request, finish time): blocks kept
        self.num_recomputes = 0  # requests recomputed from a failed load
        self.num_load_errors = 0  # blocks that did not load
        self.open: Optional[tuple[Any, Optional[LayerwiseStep], Optional[BaseException]]] = None  # the step begun

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
    def _layerwise_runner(self) -> Any:
        if self.layerwise is None:
            self.layerwise = self.runner() or False
        return self.layerwise

    def before_forward(self, sched: Any) -> None:
        """Saves of evicted blocks, then this step's loads: started here and waited for per layer inside the
        forward (or all here, on the whole-model paths). A step with nothing to run completes here."""
        if self.open is not None:  # the engine dropped the step it scheduled: its forward never ran
            self.after_forward(self.open[0], ran=False)
        self._poll_finished()
        meta = self.scheduler_side.build_connector_meta(sched)
        w = self.worker_side
        w.bind_connector_metadata(meta)
        step, error = None, None
        try:
            w.handle_preemptions(meta)
            w.start_load_kv()
        except Exception as e:  # noqa: BLE001 - a connector's failure costs a recompute, never the engine
            error = e
        runner = self._layerwise_runner() if sched.scheduled else None
        if runner:
            step = LayerwiseStep(w, self.cache_names, sched.scheduled)
            if error is not None:
                step.load_error = error
            runner.kv_connector = step  # the model runner puts it in this step's AttentionMetadata
        elif error is None:
            try:
                for name in self.layer_names:
                    w.wait_for_layer_load(name)
            except Exception as e:  # noqa: BLE001
                error = e
        self.open = (sched, step, error)
        if not sched.scheduled:
            self.after_forward(sched, ran=False)

    def after_forward(self, sched: Any, ran: bool = True) -> set[str]:
        """Saves (whole-model paths), ``wait_for_save``, then the step's load errors: a request whose loads failed
        has its step discarded (its sampled token must not be emitted) and its computed tokens rolled back to its
        first failed block. Returns the ids of those requests."""
        if self.open is None or self.open[0] is not sched:
            return set()
        _, step, error = self.open
        self.open = None
        w = self.worker_side
        if step is not None:
            runner = self._layerwise_runner()
            if runner and getattr(runner, "kv_connector", None) is step:
                runner.kv_connector = None
            error = error or step.load_error
            if error is None and ran and not set(self.layer_names) <= set(step.waited):
                # the model does not call the per-layer hooks: its reads did not wait, so nothing loaded is trusted
                logger.warning("KV connector: %s's attention layers do not call the connector's per-layer hooks; "
                               "waiting for the whole model before each forward from now on",
                               type(getattr(runner, "model", None)).__name__)
                error = RuntimeError("layers read their caches without waiting for their loads")
                self.layerwise = False
            elif error is None and not ran:
                try:  # nothing read the caches: waiting now is still in time
                    for name in self.layer_names:
                        w.wait_for_layer_load(name)
                except Exception as e:  # noqa: BLE001
                    error = e
        save_error = step.save_error if step is not None else None
        try:
            if save_error is None and (step is None or (ran and set(self.layer_names) - set(step.saved))):
                saved = set(step.saved) if step is not None else set()
                for name, cache in self.caches.items():
                    if name not in saved:
                        w.save_kv_layer(name, cache, None, scheduled=sched.scheduled)
            if save_error is None:
                w.wait_for_save()
        except Exception as e:  # noqa: BLE001 - a failed save is a later miss
            save_error = e
        if save_error is not None:
            logger.warning("KV connector %s: saving failed (%s: %s)", type(w).__name__, type(save_error).__name__,
                           save_error)
        try:
            failed = set(w.get_block_ids_with_load_errors()) if error is None else set(self.kv.pending_load)
        except Exception as e:  # noqa: BLE001
            error, failed = e, set(self.kv.pending_load)
        if error is not None and failed:
            logger.warning("KV connector %s: loading failed (%s: %s); recomputing this step's loads",
                           type(w).__name__, type(error).__name__, error)
        discarded = self._recompute(sched, failed) if failed else set()
        self.kv.pending_load.clear()
        self.scheduler_side.update_connector_output(w.build_connector_worker_meta())
        w.clear_connector_metadata()
        self._poll_finished()
        return discarded

    def _recompute(self, sched: Any, failed: set[int]) -> set[str]:
        """Roll each scheduled request whose blocks did not load back to its first failed block: the step's
        ``update`` then advances it by nothing and its sampled token is discarded."""
        bs = self.kv.block_size
        self.num_load_errors += len(failed)
        discarded = set()
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
            s.num_new_tokens, s.samples = 0, False  # (the scheduler's update adds nothing)
            req.num_cached_tokens = min(req.num_cached_tokens, valid)
            discarded.add(req.request_id)
            self.num_recomputes += 1
        return discarded

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
