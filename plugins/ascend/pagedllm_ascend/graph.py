"""ACL graphs for decode batches (opt-in: ``PAGEDLLM_ASCEND_ACL_GRAPH=1``; ``PAGEDLLM_DISABLE_GRAPHS=1`` or
``--enforce-eager`` still win). Not verified on hardware.

Core's :class:`~pagedllm.backend.graph_runner.DecodeGraphRunner` does the generic part with ``torch.npu`` as the
device module and ``torch.npu.NPUGraph`` as the graph class: one graph per decode batch-size bucket, captured
largest-first into one pool, inputs in persistent buffers. Two things are Ascend's own, both as vllm-ascend does
them (vllm-project/vllm-ascend, v0.11.0):

- ``_npu_paged_attention`` takes the context lengths as a *host* tensor, so a replayed graph would reuse the
  lengths it was captured with. Each call is captured inside ``torch.npu.graph_task_group_begin/end`` (with its
  workspace from ``_npu_paged_attention_get_workspace`` and an ``ExternalEvent`` the graph waits on), and before each
  replay the group is re-issued with this step's lengths between ``graph_task_update_begin/end`` on an update stream
  (vllm_ascend/attention/attention_v1.py ``_forward_decode_only``; vllm_ascend/compilation/acl_graph.py
  ``update_attn_params``, which vllm-ascend calls after launching the replay; we update just before it).
- Padding rows carry slot -1 (core's "skip"); ``attention.write_kv`` turns them into copies of the first real row
  without a host sync. So the warm-up and capture runs (all padding in core's runner) write somewhere harmless, the
  runner's persistent slot buffer starts with the slots of the step that triggered capture — slots that step's
  replay then overwrites with the real keys and values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import GraphRunner
from pagedllm.backend.graph_runner import DecodeGraphRunner, graphs_disabled
from pagedllm_ascend.vendor import npu, torch_npu

ENV = "PAGEDLLM_ASCEND_ACL_GRAPH"


def enabled() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0") and not graphs_disabled()


@dataclass
class CapturedAttention:
    """One ``_npu_paged_attention`` call inside a graph: what the per-replay update re-issues."""

    handle: Any
    event: Any
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    num_kv_heads: int
    num_heads: int
    scale: float
    block_table: torch.Tensor
    out: torch.Tensor
    workspace: Any


#: The list being filled while a graph is captured (None otherwise): attention records its calls here.
_capturing: Optional[list[CapturedAttention]] = None


def capturing() -> bool:
    return _capturing is not None


def capture_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            num_kv_heads: int, num_heads: int, scale: float, block_table: torch.Tensor,
                            out: torch.Tensor) -> None:
    """vllm-ascend v0.11.0 ``_forward_decode_only`` (capturing branch): workspace, event, task group."""
    assert _capturing is not None
    api, ops = npu(), torch_npu()
    lens = torch.ones(query.shape[0], dtype=torch.int32)  # placeholder: every replay updates the group first
    workspace = ops._npu_paged_attention_get_workspace(
        query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=num_kv_heads, num_heads=num_heads,
        scale_value=scale, block_table=block_table, context_lens=lens, out=out)
    stream = api.current_stream()
    event = api.ExternalEvent()
    event.wait(stream)
    event.reset(stream)
    api.graph_task_group_begin(stream)
    ops._npu_paged_attention(query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=num_kv_heads,
                             num_heads=num_heads, scale_value=scale, block_table=block_table, context_lens=lens,
                             out=out, workspace=workspace)
    handle = api.graph_task_group_end(stream)
    _capturing.append(CapturedAttention(handle, event, query, key_cache, value_cache, num_kv_heads, num_heads,
                                        scale, block_table, out, workspace))


class AscendDecodeGraphRunner(DecodeGraphRunner):
    def __init__(self, model: Callable, max_num_seqs: int, device: torch.device, max_model_len: Optional[int]):
        api = npu()
        super().__init__(model, max_num_seqs, device, api=api, graph_cls=api.NPUGraph, max_model_len=max_model_len)
        self.captured: dict[int, list[CapturedAttention]] = {}
        self.update_stream: Any = None

    def _allocate(self, meta: AttentionMetadata) -> None:
        super()._allocate(meta)
        self.slots[:meta.slot_mapping.shape[0]].copy_(meta.slot_mapping)  # see the module docstring

    def capture(self, meta: AttentionMetadata) -> None:
        """Core's capture loop (largest bucket first), keeping each bucket's recorded attention calls."""
        self.update_stream = self.api.Stream(self.device)
        self._allocate(meta)
        with torch.inference_mode():
            for b in reversed(self.buckets):
                m = self._bucket_meta(b)
                ids, pos = self.ids[:b], self.positions[:b]
                self.replays[b], self.captured[b] = self._capture(
                    lambda ids=ids, pos=pos, m=m: self.model(ids, pos, m))
                self.metas[b] = m
                self.stats["captured"].append(b)

    def _capture(self, fn: Callable[[], torch.Tensor]) -> Any:  # type: ignore[override]
        """Core's mechanism (side-stream warm-up, one pool) with this graph's attention calls recorded."""
        global _capturing
        api = self.api
        stream = api.Stream(self.device)
        stream.wait_stream(api.current_stream(self.device))
        with api.stream(stream):
            for _ in range(2):
                fn()
        api.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = api.graph_pool_handle()
        graph = self.graph_cls()
        recorded: list[CapturedAttention] = []
        _capturing = recorded
        try:
            with api.graph(graph, pool=self._pool):
                out = fn()
        finally:
            _capturing = None

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay, recorded

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, n: int,
              b: int) -> None:
        super()._load(input_ids, positions, meta, n, b)
        lens = torch.tensor(list(meta.seq_lens_cpu) + [1] * (b - n), dtype=torch.int32)
        api, ops, stream = self.api, torch_npu(), self.update_stream
        with api.stream(stream):  # vllm_ascend/compilation/acl_graph.py update_attn_params (v0.11.0)
            for c in self.captured[b]:
                workspace = ops._npu_paged_attention_get_workspace(
                    query=c.query, key_cache=c.key_cache, value_cache=c.value_cache, num_kv_heads=c.num_kv_heads,
                    num_heads=c.num_heads, scale_value=c.scale, block_table=c.block_table, context_lens=lens,
                    out=c.out)
                api.graph_task_update_begin(stream, c.handle)
                ops._npu_paged_attention(query=c.query, key_cache=c.key_cache, value_cache=c.value_cache,
                                         num_kv_heads=c.num_kv_heads, num_heads=c.num_heads, scale_value=c.scale,
                                         block_table=c.block_table, context_lens=lens, out=c.out,
                                         workspace=workspace)
                api.graph_task_update_end(stream)
                c.event.record(stream)


def make_runner(model: Any, max_num_seqs: int, device: torch.device, ctx: Any) -> GraphRunner:
    """Eager unless opted in; then decode graphs (prefill and mixed batches stay eager)."""
    if not enabled():
        return GraphRunner(run=model, level="none", stats={"strategy": "eager", "opt_in": f"{ENV}=1"})
    info = getattr(ctx, "model_info", None)
    if info is not None and info.sliding_window is not None:
        return GraphRunner(run=model, level="none", stats={
            "strategy": "eager", "reason": "sliding-window decode runs npu_fused_infer_attention_score, whose host "
                                           "lengths the per-replay update does not cover; only _npu_paged_attention "
                                           "is captured"})
    runner = AscendDecodeGraphRunner(model, max_num_seqs, device,
                                     max_model_len=ctx.max_model_len if ctx is not None else None)
    return GraphRunner(run=runner, level="decode", stats=runner.stats)
