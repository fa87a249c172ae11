"""Device graphs for decode-only batches, shared by every backend whose torch device module has a graph API:
``Stream``, ``current_stream``, ``stream``, ``graph``, ``graph_pool_handle`` and a graph class named after the device
type (:func:`graph_class`). The device module is a parameter, ``torch.get_device_module(device)`` by default, so no
vendor module is named or imported here.

Decode steps are launch-bound, so we capture the model forward once per batch-size bucket and replay it. A batch of
``n`` decodes is padded to the smallest captured bucket ``>= n``; the graphs read their inputs from persistent buffers
that each step overwrites (padding rows get ``seq_len=1``, ``slot=-1`` so they write nothing). Buckets are captured
largest-first into one memory pool, so the smaller graphs reuse the largest one's memory. Prefill and mixed batches,
and batches wider than the captured block table, run eagerly.

Inside a graph only device tensors are live: the metadata's ``seq_lens_cpu`` raises when read (its length is the
bucket size), ``query_start_loc_cpu`` is the bucket's constant ``0..b``, ``max_seq_len`` is the most the block table
addresses. Kernels must size launches from shapes and constants, never from per-step host values.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import GraphRunner


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16, and ``max_num_seqs`` itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class HostValuesUnavailable(list):
    """Stand-in for per-step host lists inside a captured graph: has a length, refuses to be read."""

    def _refuse(self, *args: Any) -> Any:
        raise RuntimeError("per-step host metadata (seq_lens_cpu) is not available inside a captured graph; "
                           "read the device tensor meta.seq_lens instead")

    __getitem__ = __iter__ = __contains__ = _refuse  # type: ignore[assignment]


def graph_class(device_module: Any, device_type: str) -> Optional[type]:
    """The graph class of ``device_module``, or None when it has none: torch names it after the device type
    (``torch.<type>.<TYPE>Graph``), and so do the device modules vendors register for their own types."""
    return getattr(device_module, f"{device_type.upper()}Graph", None)


class DecodeGraphRunner:
    """``runner(input_ids, positions, meta) -> hidden_states``: graphs for decodes, eager for everything else.

    ``model(input_ids, positions, meta)`` must keep its KV caches in persistent tensors (it does: the engine
    allocates them once). Capture happens on the first decode-only call, when the caches exist. The returned hidden
    states of a replayed step are a view of the graph's static output, valid until the next call.
    """

    def __init__(self, model: Callable, max_num_seqs: int, device: torch.device,
                 buckets: Optional[list[int]] = None, api: Any = None, graph_cls: Any = None,
                 max_model_len: Optional[int] = None):
        self.model = model
        self.device = torch.device(device)
        self.api = api if api is not None else torch.get_device_module(self.device)  # the device module
        self.graph_cls = graph_cls if graph_cls is not None else graph_class(self.api, self.device.type)
        # The engine's configured length (RunnerContext), not the model's: the buffers are that wide.
        self.max_model_len = max_model_len
        self.buckets = sorted(set(buckets or default_buckets(max_num_seqs)))
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.width = 0
        self.stats: dict = {"buckets": self.buckets, "captured": [], "replays": 0, "eager": 0}
        self._pool: Any = None

    # ---- the mechanism (the only part that speaks the device module's graph API) ---------------------------------
    def _capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Warm ``fn`` up on a side stream, capture it into the shared pool, return a replay function."""
        api = self.api
        if self.graph_cls is None:
            raise RuntimeError(f"{getattr(api, '__name__', api)} has no graph class for {self.device.type!r} devices")
        stream = api.Stream(self.device)
        stream.wait_stream(api.current_stream(self.device))
        with api.stream(stream):
            for _ in range(2):  # compiles Triton kernels, sets up library workspaces outside the capture
                fn()
        api.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = api.graph_pool_handle()
        graph = self.graph_cls()
        with api.graph(graph, pool=self._pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    # ---- buffers, capture, replay -------------------------------------------------------------------------------
    @torch.inference_mode(False)  # plain tensors: later steps may update them in or out of inference mode
    def _allocate(self, meta: AttentionMetadata) -> None:
        b, dev = self.buckets[-1], self.device
        max_len = int(self.max_model_len or getattr(self.model, "max_model_len", 0) or 0)
        self.width = max(meta.block_tables.shape[1], -(-max_len // meta.block_size))
        self.block_size = meta.block_size
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((b, self.width), dtype=torch.int32, device=dev)
        self.slots = torch.full((b,), -1, dtype=torch.long, device=dev)

    def _bucket_meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.qsl[:b + 1], seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b],
            slot_mapping=self.slots[:b], max_query_len=1, max_seq_len=self.width * self.block_size, num_decodes=b,
            block_size=self.block_size, query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=HostValuesUnavailable(
                [0] * b))

    def capture(self, meta: AttentionMetadata) -> None:
        """Capture every bucket, largest first (its memory is then reused by the smaller ones)."""
        self._allocate(meta)
        with torch.inference_mode():
            for b in reversed(self.buckets):
                m = self._bucket_meta(b)
                ids, pos = self.ids[:b], self.positions[:b]
                self.replays[b] = self._capture(lambda ids=ids, pos=pos, m=m: self.model(ids, pos, m))
                self.metas[b] = m
                self.stats["captured"].append(b)

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, n: int, b: int) -> None:
        w = meta.block_tables.shape[1]
        self.ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :w].copy_(meta.block_tables)
        self.block_tables[:n, w:].zero_()
        self.slots[:n].copy_(meta.slot_mapping)
        if b > n:  # padding rows: read one harmless slot, write nothing
            self.ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b].zero_()
            self.slots[n:b].fill_(-1)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = meta.seq_lens.shape[0]
        graphable = (meta.max_query_len == 1 and 0 < n <= self.buckets[-1] and input_ids.dim() == 1
                     and input_ids.shape[0] == n)
        if graphable and not self.replays:
            self.capture(meta)
        if not graphable or meta.block_tables.shape[1] > self.width or meta.block_size != self.block_size:
            self.stats["eager"] += 1
            return self.model(input_ids, positions, meta)
        b = next(s for s in self.buckets if s >= n)
        self._load(input_ids, positions, meta, n, b)
        self.stats["replays"] += 1
        return self.replays[b]()[:n]


def graphs_disabled() -> bool:
    return os.environ.get("PAGEDLLM_DISABLE_GRAPHS", "0") not in ("", "0")


def make_graph_runner(model: Callable, max_num_seqs: int, device: torch.device, ctx: Any = None, api: Any = None,
                      graph_cls: Any = None) -> GraphRunner:
    """The ``pagedllm_graph_runner`` result for devices with a graph API (``PAGEDLLM_DISABLE_GRAPHS=1``: eager).
    ``ctx`` (a RunnerContext, absent for v1 callers) sizes the buffers from the configured max_model_len."""
    if graphs_disabled():
        return GraphRunner(run=model, level="none", stats={"disabled_by": "PAGEDLLM_DISABLE_GRAPHS"})
    runner = DecodeGraphRunner(model, max_num_seqs, device, api=api, graph_cls=graph_cls,
                               max_model_len=ctx.max_model_len if ctx is not None else None)
    return GraphRunner(run=runner, level="decode", stats=runner.stats)
