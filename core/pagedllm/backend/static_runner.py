"""A graph runner for static-shape backends: one captured program per bucket shape, replayed from persistent buffers.

What a compiled-graph device (a graph compiler, device graphs replayed per shape) needs from a step, in one
device-neutral class: the batch policy pads every step to a bucket (``pagedllm.worker.model_runner``); this runner owns, per
bucket, persistent input and metadata tensors, captures the forward once over them (at warm-up, through the
backend's ``capture`` function) and replays it on every later step after copying the step's values in. A shape
outside the warmed-up set is an error, never a silent recompile. ``sample`` runs logits and sampling
(``device_sampler.sample``) in the same captured program.

``capture(fn) -> replay`` is the backend's mechanism (a device module's ``graph`` capture, a vendor's graph wrapper,
``torch.compile(dynamic=False)``...); ``fn`` and ``replay`` take no arguments. The default, :func:`eager_capture`,
re-runs ``fn`` on the buffers: the CPU backend's static mode uses it to exercise the whole static path (padding,
buckets, warm-up, buffers, on-device sampling) on a machine without the device.

Each bucket's ``fn`` is a function of its own (:func:`bucket_callable`): its own code object, calling the program with
the bucket's tensors as explicit arguments. ``torch.compile`` keeps one cache, and one recompile count, per code
object: closures sharing one code object would recompile for every bucket and, past torch's recompile limit (8),
silently run eagerly. Graph breaks inside the model still resume in frames every bucket shares, so compile with
``fullgraph=True`` (or raise ``torch._dynamo.config.recompile_limit`` to the bucket count).

Models with recurrent state (contract v3: ``model.state_shapes``) get two more persistent buffers per bucket,
``state_indices`` and ``has_initial_state``: the model runner pads them with slot -1 (and ``False``), which every
state op skips (neither read nor written), and warm-up, whose metadata names no slot, fills them that way too. The
state ops plan on host values (each sequence's span and slot: ``tolist()``, ``nonzero()``), so a capture other than
:func:`eager_capture` would freeze them: unless the backend says its capture takes them (``capture_state``), the
steps of such a model run eagerly over the bucket's buffers — same shapes, same buffers, no captured program — with
one log line, as steps carrying image embeddings do.

Host-side metadata (``query_start_loc_cpu``, ``seq_lens_cpu``, ``num_decodes``...) is refreshed on the persistent
metadata object every step for kernels that plan on the host; a kernel that runs inside a real captured graph must
read only the device tensors (``AttentionMetadata`` lists which ones the model reads).
"""

from __future__ import annotations

import logging
import types
from collections import Counter
from typing import Any, Callable, Optional

import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.batch_policy import BatchShape
from pagedllm.backend.device_sampler import SamplingTensors, sample as device_sample
from pagedllm.backend.hookspec import GraphRunner, RunnerContext

logger = logging.getLogger(__name__)

Capture = Callable[[Callable[[], Any]], Callable[[], Any]]


def eager_capture(fn: Callable[[], Any]) -> Callable[[], Any]:
    """The identity capture: replay re-executes ``fn`` (which reads only the persistent buffers)."""
    return fn


def batch_shape(input_ids: torch.Tensor, meta: AttentionMetadata) -> BatchShape:
    return BatchShape(int(input_ids.shape[0]), int(meta.seq_lens.shape[0]), int(meta.block_tables.shape[1]))


def forward_program(model: Any, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """A bucket's forward: hidden states ``[T, hidden]``."""
    return model(ids, positions, meta)


def sample_program(model: Any, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   logits_indices: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """A bucket's forward, logits of ``logits_indices`` and on-device sampling: token ids ``[S]``."""
    hidden = model(ids, positions, meta)
    logits = model.compute_logits(hidden.index_select(0, logits_indices)).float()
    return device_sample(logits, sampling)


def bucket_callable(program: Callable[..., Any], shape: BatchShape, *inputs: Any) -> Callable[[], Any]:
    """``program(*inputs)`` as a zero-argument function with a code object of its own (named after ``shape``), so a
    compiler that caches per code object (``torch.compile``) compiles each bucket once, into a cache of its own."""
    def call() -> Any:
        return program(*inputs)

    name = f"{program.__name__}_{shape.num_tokens}x{shape.num_seqs}x{shape.num_blocks}"
    return types.FunctionType(call.__code__.replace(co_name=name), call.__globals__, name, None, call.__closure__)


class _Bucket:
    """Persistent tensors of one shape and the program captured over them."""

    def __init__(self, shape: BatchShape, block_size: int, device: torch.device, state: bool = False):
        self.shape = shape
        t, s, w = shape
        self.ids = torch.zeros(t, dtype=torch.long, device=device)
        self.positions = torch.zeros(t, dtype=torch.long, device=device)
        self.logits_indices = torch.zeros(s, dtype=torch.long, device=device)
        self.sampling = SamplingTensors.build([], s, device)
        self.meta = AttentionMetadata(
            query_start_loc=torch.zeros(s + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(s, dtype=torch.int32, device=device),
            block_tables=torch.zeros((s, w), dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(t, dtype=torch.int64, device=device),
            max_query_len=0, max_seq_len=0, num_decodes=0, block_size=block_size)
        if state:  # recurrent state: each row's slot (-1: padding, skipped by every state op) and continuation flag
            self.meta.state_indices = torch.full((s,), -1, dtype=torch.int32, device=device)
            self.meta.has_initial_state = torch.zeros(s, dtype=torch.bool, device=device)
        self.forward: Optional[Callable[[], torch.Tensor]] = None
        self.forward_sample: Optional[Callable[[], torch.Tensor]] = None

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        m = self.meta
        self.ids.copy_(input_ids)
        self.positions.copy_(positions)
        m.query_start_loc.copy_(meta.query_start_loc)
        m.seq_lens.copy_(meta.seq_lens)
        m.block_tables.copy_(meta.block_tables)
        m.slot_mapping.copy_(meta.slot_mapping)
        if m.state_indices is not None:
            if meta.state_indices is None:  # warm-up / profiling metadata names no slot: every row is padding
                m.state_indices.fill_(-1)
                m.has_initial_state.fill_(False)
            else:
                m.state_indices.copy_(meta.state_indices)
                m.has_initial_state.copy_(meta.has_initial_state)
        m.max_query_len, m.max_seq_len, m.num_decodes = meta.max_query_len, meta.max_seq_len, meta.num_decodes
        m.query_start_loc_cpu, m.seq_lens_cpu = meta.query_start_loc_cpu, meta.seq_lens_cpu
        m.extra = {}  # kernels cache per-step plans here


class StaticGraphRunner:
    """``run(input_ids, positions, meta)`` / ``sample(...)`` over the bucket shapes of ``ctx.policy``."""

    def __init__(self, model: Any, ctx: RunnerContext, capture: Capture = eager_capture, capture_state: bool = False):
        self.model, self.ctx = model, ctx
        self.state = bool(getattr(model, "state_shapes", None))  # a model with recurrent state (state slots)
        self.shapes = frozenset(ctx.policy.warmup_shapes())
        self.buckets: dict[BatchShape, _Bucket] = {}
        self.shapes_seen: Counter = Counter()
        # carries_state: the worker hands stateful models to this runner (state slots ride in the bucket buffers)
        self.stats: dict = {"buckets": len(self.shapes), "captures": 0, "replays": 0, "shapes_seen": self.shapes_seen,
                            "carries_state": True}
        if self.state and capture is not eager_capture and not capture_state:
            logger.info("%s keeps recurrent state, whose ops plan on host values a captured graph would freeze: its "
                        "steps run eagerly over the bucket buffers (no captured program)", type(model).__name__)
            capture = eager_capture
            self.stats["state_steps"] = "eager"
        self.capture = capture

    def _bucket(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> _Bucket:
        shape = batch_shape(input_ids, meta)
        if shape not in self.shapes:
            raise RuntimeError(f"batch shape {tuple(shape)} (tokens, seqs, block-table width) is not one of the "
                               f"{len(self.shapes)} warmed-up bucket shapes: the batch policy did not pad this step")
        self.shapes_seen[shape] += 1
        b = self.buckets.get(shape)
        if b is None:
            b = self.buckets[shape] = _Bucket(shape, self.ctx.block_size, self.ctx.device, self.state)
        return b

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        b = self._bucket(input_ids, meta)
        b.load(input_ids, positions, meta)
        if b.forward is None:
            b.forward = self.capture(bucket_callable(forward_program, b.shape, self.model, b.ids, b.positions, b.meta))
            self.stats["captures"] += 1
        else:
            self.stats["replays"] += 1
        return b.forward()

    def sample(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               logits_indices: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
        """Forward, logits of ``logits_indices`` and sampling as one captured program; returns token ids [S]."""
        b = self._bucket(input_ids, meta)
        b.load(input_ids, positions, meta)
        b.logits_indices.copy_(logits_indices)
        for name in ("temperature", "top_k", "top_p", "min_p"):
            getattr(b.sampling, name).copy_(getattr(tensors, name))
        if b.forward_sample is None:
            b.forward_sample = self.capture(bucket_callable(sample_program, b.shape, self.model, b.ids, b.positions,
                                                            b.meta, b.logits_indices, b.sampling))
            self.stats["captures"] += 1
        else:
            self.stats["replays"] += 1
        return b.forward_sample()


def make_static_runner(model: Any, ctx: RunnerContext, capture: Capture = eager_capture, level: str = "full",
                       on_device_sampling: bool = True, capture_state: bool = False) -> GraphRunner:
    """A ``GraphRunner`` for ``pagedllm_graph_runner`` on a static-shape device: one program per bucket shape of
    ``ctx.policy``, captured at warm-up over persistent buffers and replayed every step.

    ``capture(fn) -> replay`` turns one bucket's program into what replays it (``fn`` and ``replay`` take no
    arguments: the bucket's buffers are bound inside ``fn``); the default re-runs ``fn`` eagerly, a device passes its
    graph capture or e.g. ``functools.partial(torch.compile, dynamic=False, fullgraph=True)``. ``level`` is reported
    as ``GraphRunner.level``. ``on_device_sampling`` also captures forward + logits + sampling per bucket
    (``GraphRunner.sample``; declare ``Capabilities.on_device_sampling``). ``capture_state``: ``capture`` takes the
    recurrent-state ops of a model with state (their kernels read only device tensors); otherwise such a model's
    steps run eagerly over the bucket buffers (module docstring)."""
    runner = StaticGraphRunner(model, ctx, capture, capture_state)
    return GraphRunner(run=runner.run, level=level, stats=runner.stats,
                       sample=runner.sample if on_device_sampling else None)
