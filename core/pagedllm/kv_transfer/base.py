"""The KV-connector contract: everything a connector implements, in one file (vLLM V1's ``KVConnectorBase_V1``).

A connector moves KV-cache blocks between the engine's device pool and something outside it: host memory, disk, a
remote instance (a transfer engine over RDMA, HCCS, ICI...). It is found by name through the
``pagedllm.kv_connectors`` entry-point group (:data:`ENTRY_POINT_GROUP`; built-ins: ``OffloadingConnector``,
``LoopbackConnector``) and selected with ``--kv-transfer-config`` / ``LLM(kv_transfer_config=...)`` in vLLM's shape::

    {"kv_connector": "MyConnector", "kv_role": "kv_both", "kv_connector_extra_config": {...}}

Core builds two instances of the class, one per :class:`KVConnectorRole`; they talk only through the metadata the
scheduler side builds each step (:meth:`KVConnectorBase_V1.build_connector_meta`) and the worker side's report
(:meth:`KVConnectorBase_V1.build_connector_worker_meta`), so the halves may live in different processes.

One engine step, in call order:

Scheduler side (the scheduler's thread, no device work):
  1. :meth:`~KVConnectorBase_V1.get_num_new_matched_tokens` for a waiting request, after the device prefix cache:
     how many more tokens (whole blocks, leaving at least one prompt token to compute) the connector can load.
  2. :meth:`~KVConnectorBase_V1.update_state_after_alloc` once the request got its blocks (always called, with
     ``num_external_tokens`` 0 when nothing is loaded): ``block_ids`` is the request's whole block table; the blocks
     of its tokens ``[num_computed_tokens, num_computed_tokens + num_external_tokens)`` are the load targets.
  3. :meth:`~KVConnectorBase_V1.on_block_evicted` (pagedllm's addition for a prefix-cache tier) whenever a cached
     block leaves the free queue for reuse: its K/V is still intact until this step's forward.
  4. :meth:`~KVConnectorBase_V1.build_connector_meta` once per step: everything the worker side must do; it resets
     the connector's per-step state.
  5. :meth:`~KVConnectorBase_V1.request_finished` once per finished request, before its blocks are freed:
     ``(True, params)`` keeps the blocks until the worker side reports the id from ``get_finished``.
  6. :meth:`~KVConnectorBase_V1.update_connector_output` with the worker side's report of the step.

Worker side (with the device caches):
  1. :meth:`~KVConnectorBase_V1.register_kv_caches` once, with the device caches (``{layer name: cache}``, in the
     backend's own layout).
  2. each step: ``bind_connector_metadata(meta)``, :meth:`~KVConnectorBase_V1.handle_preemptions` (copy out blocks
     about to be overwritten: evictions), :meth:`~KVConnectorBase_V1.start_load_kv`, the forward, in which each
     attention layer calls :meth:`~KVConnectorBase_V1.wait_for_layer_load` right before it reads its cache and
     :meth:`~KVConnectorBase_V1.save_kv_layer` right after it wrote it (vLLM's attention layer; on paths that
     cannot call back per layer — replayed graphs, a backend's own runner, several ranks — every wait comes before
     the forward and every save after it), then :meth:`~KVConnectorBase_V1.wait_for_save`,
     :meth:`~KVConnectorBase_V1.get_block_ids_with_load_errors`, :meth:`~KVConnectorBase_V1.get_finished`,
     ``clear_connector_metadata()``.

Device <-> host copies go through the backend's swap hooks (:attr:`KVConnectorContext.allocate_host_kv_cache`,
:attr:`~KVConnectorContext.swap_kv_blocks`, :attr:`~KVConnectorContext.gather_kv_blocks`), so a connector works on
any backend's layout without a hook of its own.

Failures are first class: a block the worker side could not load (missing, corrupted, timed out) is reported by
:meth:`~KVConnectorBase_V1.get_block_ids_with_load_errors` after the step's forward (a layer may find it late, after
earlier layers read the block); core then discards that request's step (its sampled token is never emitted), rolls
its computed tokens back to the first failed block, drops the failed blocks from the prefix cache and recomputes
them. A connector that raises in a worker call fails the loads of that step the same way.
``pagedllm.kv_transfer.conformance.check_connector`` exercises this contract against a class.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

#: Entry-point group a connector distribution registers under (``name = "module:Class"``).
ENTRY_POINT_GROUP = "pagedllm.kv_connectors"


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0  # beside the scheduler: matching, allocation updates, per-step metadata
    WORKER = 1  # beside the device caches: loads and saves


class KVConnectorMetadata:  # noqa: B903 - a connector subclasses it with its own fields
    """What the scheduler side tells the worker side for one step (picklable when the halves are processes)."""


@dataclass
class KVConnectorContext:
    """What core hands both halves. Scheduler side: ``block_hashes(request, num_tokens)`` gives the chained hashes of
    the request's full blocks among its first ``num_tokens`` tokens, the same keys as the device prefix cache.
    Worker side: the device caches' :class:`~pagedllm.backend.KVCacheSpec` and the backend's block-copy hooks."""

    model_identity: str  # stable digest of the checkpoint, dtype, KV dtype and block size: a store's namespace
    block_size: int
    num_device_blocks: int
    bytes_per_block: int  # one block over all layers, as allocated
    kv_spec: Any = None  # pagedllm.backend.KVCacheSpec of the device caches
    layer_names: list[str] = field(default_factory=list)
    block_hashes: Optional[Callable[[Any, int], list[bytes]]] = None
    block_ids: Optional[Callable[[str], list[int]]] = None  # request id -> its device block table (scheduler side)
    allocate_host_kv_cache: Optional[Callable[[Any, bool], list]] = None  # (spec, pin_memory) -> host caches
    swap_kv_blocks: Optional[Callable[..., None]] = None  # (src caches, dst caches, src ids, dst ids)
    gather_kv_blocks: Optional[Callable[..., Any]] = None  # (cache, block ids) -> canonical [2, n, bs, h, d]
    pin_memory: bool = False


class KVConnectorBase_V1(ABC):  # noqa: N801 - vLLM's name
    """Base class of every KV connector. ``config`` is the parsed :class:`~pagedllm.kv_transfer.KVTransferConfig`."""

    def __init__(self, config: Any, role: KVConnectorRole, context: KVConnectorContext):
        self.config = config
        self.role = role
        self.context = context
        self._connector_metadata: Optional[KVConnectorMetadata] = None

    # ---- worker side -------------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "no metadata bound for this step"
        return self._connector_metadata

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """The device caches, one per layer, in the backend's layout (pre-register them with a transfer engine)."""

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        """Copy out blocks that this step will overwrite (evicted prefix-cache blocks), before anything else runs."""

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Start loading the bound metadata's blocks into the device caches (may return before they land)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s loads are in the device cache (called inside the forward, right before that
        layer reads its cache; load only that layer's blocks here to overlap the earlier layers). Bound the wait (a
        remote peer may be gone): a load that times out goes into ``get_block_ids_with_load_errors`` and its request
        is recomputed; core cannot interrupt a call that never returns."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Start saving what the bound metadata asks of ``layer_name`` (called right after the layer wrote its cache).
        ``attn_metadata`` is the step's ``AttentionMetadata`` (None on the whole-model paths, called after the
        forward); ``scheduled`` is the step's ``ScheduledRequest`` list. The block ids to save may come from the
        connector's own metadata."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves no longer read the device caches (they may be reused next step)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """``(done sending, done receiving)`` request ids: a finished request whose ``request_finished`` returned
        True has its blocks freed once its id comes back here. ``finished_req_ids``: requests that finished since
        the last call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device block ids this step's loads did not fill (core recomputes from the first of a request's)."""
        return set()

    def build_connector_worker_meta(self) -> Optional[dict]:
        """What the worker side reports back to the scheduler side after a step (``update_connector_output``)."""
        return None

    def get_stats(self) -> dict[str, float]:
        """Counters for the engine stats and /metrics (``kv_offload``): name -> value, summed over both halves."""
        return {}

    def shutdown(self) -> None:
        """Release host memory, files, connections."""

    # ---- scheduler side ----------------------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Tokens beyond ``num_computed_tokens`` (the device prefix-cache hit) the connector can load: a multiple
        of the block size, leaving at least the request's last token to compute, and only what is loadable now.
        Returns ``(tokens, load_async)``; pagedllm loads within the step (started before the forward, waited for
        per layer), so ``load_async`` must be False (None tokens means "ask again next step")."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """The request got its blocks; decide the loads from ``num_external_tokens`` (0: nothing to load)."""

    def on_block_evicted(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """A prefix-cache block (full, hashed) is being reused for other tokens: its K/V is intact until this step's
        forward, so a save scheduled now (``handle_preemptions``) still reads it."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's work for the worker side; resets the per-step state. Must not change ``scheduler_output``."""

    def update_connector_output(self, connector_output: Optional[dict]) -> None:
        """The worker side's ``build_connector_worker_meta`` of the step."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """Called once when a request finishes, before its blocks are freed: ``(delay_free, kv_transfer_params)``.
        ``delay_free`` True keeps the blocks until the worker side reports the request from ``get_finished``."""
        return False, None
