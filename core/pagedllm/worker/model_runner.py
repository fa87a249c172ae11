"""Turns one scheduled step into flat device tensors, runs the model, and returns logits for sampling rows.

Under a static batch policy every tensor is padded to the step's bucket: padding tokens (id 0, position 0) write to
the policy's pad slot, padding sequences have no query tokens and ``seq_len`` 0, block tables are padded with block 0
to the bucket width, ``query_start_loc`` repeats its last value. Kernels therefore see only bucket shapes, and the
``*_cpu`` mirrors and ``num_tokens`` still describe the real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.batch_policy import BatchPolicy, BatchShape
from pagedllm.backend.device_sampler import SamplingTensors, on_device_eligible
from pagedllm.sched.kv_manager import KVCacheManager
from pagedllm.lora.ops import LoRAMapping
from pagedllm.multimodal.encoder_runner import EncoderRunner
from pagedllm.multimodal.mrope import step_mrope_positions
from pagedllm.sched.request import Request
from pagedllm.sample.sampler import SamplerOutput
from pagedllm.sched.scheduler import ScheduledRequest



def prompt_logit_spans(batch: list, query_start_loc_cpu: list) -> Iterator[tuple[Any, int, int, int]]:
    """``(request, first prompt position, start row, stop row)`` of this step's hidden rows whose logits a request's
    prompt logprobs still need. Position p's logits predict token p + 1: prompt tokens 1..P-1 need positions
    0..P-2, once each (across chunked prefill and preemption). Shared by every model runner."""
    for i, s in enumerate(batch):
        r = s.request
        if r.prompt_logprobs is None:
            continue
        lo = max(s.num_computed_tokens, len(r.prompt_logprobs) - 1)
        hi = min(s.num_computed_tokens + s.num_new_tokens, r.num_prompt_tokens - 1)
        if lo < hi:
            base = query_start_loc_cpu[i] - s.num_computed_tokens
            yield r, lo, base + lo, base + hi

def group_tables(groups: list[list[list[int]]], shape: BatchShape, row: np.ndarray, pos: np.ndarray, bs: int,
                 pad_slot: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per KV group: the block table ``[seqs, blocks]`` of the step's shape and each token's slot (padding tokens
    at ``pad_slot``), from ``groups[seq][group]`` (each sequence's tables, all of one length)."""
    bts, slots = [], []
    for g in range(len(groups[0])):
        bt = np.zeros((shape.num_seqs, shape.num_blocks), dtype=np.int32)
        for i, t in enumerate(groups):
            bt[i, :len(t[g])] = t[g]
        s = np.full(shape.num_tokens, pad_slot, dtype=np.int64)
        s[:len(pos)] = bt[row, pos // bs].astype(np.int64) * bs + pos % bs
        bts.append(bt)
        slots.append(s)
    return bts, slots


def _not_decode(s: ScheduledRequest, fresh_is_prefill: bool) -> bool:
    """Sort key putting decodes first: one new token, continuing the sequence where ``fresh_is_prefill``."""
    return s.num_new_tokens != 1 or (fresh_is_prefill and s.num_computed_tokens == 0)


class ModelRunner:
    def __init__(self, model: Any, run: Any, kv: KVCacheManager, device: torch.device,
                 policy: BatchPolicy = BatchPolicy(), pad_slot: int = -1, sample: Any = None, lora: Any = None):
        self.model = model
        self.run = run  # the backend's graph runner callable: run(input_ids, positions, meta) -> hidden
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.policy = policy
        self.pad_slot = pad_slot
        self.sample = sample  # GraphRunner.sample: forward + logits + sampling in the backend's region
        self.lora = lora  # pagedllm.lora.slots.LoRAManager when LoRA is enabled
        self.keep_hidden = False  # return the target's hidden states (an EAGLE head drafts from them)
        # A pipeline-parallel executor's non-blocking forward (executor/base.py): returns a callable that waits for
        # the logits, so the engine can run the next batch's first stage meanwhile. None: ``forward_logits``.
        self.submit_logits: Optional[Callable[..., Callable[[], Optional[torch.Tensor]]]] = None
        # The pooling runner (pagedllm.pooling.Pooler): steps return pooled tensors instead of logits
        self.pooler: Any = None
        # False: an encoder-only model (no KV cache): no blocks, no slots (its attention is the unpaged varlen hook)
        self.requires_kv_cache = bool(getattr(model, "requires_kv_cache", True))
        # A vision-language model: its encoder runs here, outputs kept by image hash (pagedllm.multimodal)
        self.encoder_runner = EncoderRunner(model, device) if hasattr(model, "embed_multimodal") else None
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))  # Qwen-VL's 3-D positions (multimodal/mrope.py)
        # Sliding-window KV groups (sched/kv_groups.py): one block table per group, a metadata view each
        self.kv_groups = getattr(kv, "layout", None) is not None and self.requires_kv_cache
        # The step's per-layer KV-connector calls (kv_transfer.runtime.LayerwiseStep), bound by the connector runtime
        # for one step and handed to the model in the step's metadata; None: no connector, or whole-model calls
        self.kv_connector: Any = None

    def prepare(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        qlens = np.fromiter((s.num_new_tokens for s in batch), dtype=np.int64, count=len(batch))
        starts = np.fromiter((s.num_computed_tokens for s in batch), dtype=np.int64, count=len(batch))
        seq_lens = starts + qlens
        groups = [self.kv.group_block_ids(s.request.request_id) for s in batch] if self.kv_groups else None
        tables = ([self.kv.block_ids(s.request.request_id) for s in batch] if groups is None and self.requires_kv_cache
                  else [g[0] for g in groups] if groups is not None else [[] for _ in batch])
        width = max(1, max(len(t) for t in tables))
        real = BatchShape(int(qlens.sum()), len(batch), width)
        shape = self.policy.pad(real)
        bt = np.zeros((shape.num_seqs, shape.num_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        if int(qlens.max()) == 1:  # pure decode step: one token each
            tokens = [s.request.all_token_ids[s.num_computed_tokens] for s in batch]
            pos = starts
            row = np.arange(len(batch))
        else:
            tokens = []
            for s in batch:
                tokens.extend(s.request.all_token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens])
                if s.spec_token_ids:  # speculative proposals follow the last real token
                    tokens.extend(s.spec_token_ids)
            row = np.repeat(np.arange(len(batch)), qlens)
            pos = np.arange(int(qlens.sum())) - np.repeat(np.cumsum(qlens) - qlens, qlens) + starts[row]
        slots = (bt[row, pos // bs].astype(np.int64) * bs + pos % bs if self.requires_kv_cache
                 else np.full(len(tokens), self.pad_slot, dtype=np.int64))
        if groups is not None:  # every group's table and slots (sliding groups: null entries read as block 0)
            group_bt, group_slots = group_tables(groups, shape, row, pos, bs, self.pad_slot)
        mpos = None
        if self.uses_mrope:  # M-RoPE: the model's positions run behind token indices after an image
            pos, mpos = step_mrope_positions([s.request for s in batch], pos, row)
        qsl = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        not_decode = (qlens != 1) | (starts == 0) if self.kv.state_slots is not None else qlens != 1
        num_decodes = int(np.argmax(not_decode)) if not_decode.any() else len(batch)
        if shape != real:
            pad_t, pad_s = shape.num_tokens - real.num_tokens, shape.num_seqs - real.num_seqs
            tokens = list(tokens) + [0] * pad_t
            pos = np.concatenate([pos, np.zeros(pad_t, dtype=np.int64)])
            slots = np.concatenate([slots, np.full(pad_t, self.pad_slot, dtype=np.int64)])
            qsl = np.concatenate([qsl, np.full(pad_s, qsl[-1], dtype=np.int64)])
            seq_lens = np.concatenate([seq_lens, np.zeros(pad_s, dtype=np.int64)])
        dev = self.device
        lora_mapping = self._lora_mapping(batch, row, shape.num_tokens) if self.lora is not None else None
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(bt).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=int(qlens.max()),
            max_seq_len=int(seq_lens.max()),
            num_decodes=num_decodes,
            block_size=bs,
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            lora_mapping=lora_mapping,
            kv_connector=self.kv_connector,
        )
        if mpos is not None:  # a step with image tokens: their 3-D positions (padding rows at 0)
            meta.extra["mrope_positions"] = torch.from_numpy(
                np.pad(mpos, ((0, 0), (0, shape.num_tokens - mpos.shape[1])))).to(dev)
        state = self.kv.state_slots
        if state is not None:  # recurrent state: each sequence's slot, and whether its chunk continues the sequence
            idx = [state.slot_of(s.request.request_id) for s in batch] + [-1] * (shape.num_seqs - real.num_seqs)
            meta.state_indices = torch.tensor(idx, dtype=torch.int32).to(dev)
            meta.has_initial_state = torch.from_numpy(np.concatenate(
                [starts > 0, np.zeros(shape.num_seqs - real.num_seqs, dtype=bool)])).to(dev)
        if groups is not None:
            meta.kv_group_tables = [(torch.from_numpy(b).to(dev), torch.from_numpy(m).to(dev))
                                    for b, m in zip(group_bt, group_slots)]
        input_ids = torch.tensor(tokens, dtype=torch.long).to(dev)
        positions = torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64)).to(dev)
        return input_ids, positions, meta

    def _lora_mapping(self, batch: list[ScheduledRequest], row: np.ndarray, num_tokens: int) -> Optional[LoRAMapping]:
        """Token -> device slot of its request's adapter (-1: base model, and padding); None if no token has one."""
        ids = [s.request.lora_int_id for s in batch]
        if not any(ids):
            return None
        slot_of = self.lora.activate(i for i in ids if i)
        req_slot = np.array([slot_of[i] if i else -1 for i in ids], dtype=np.int64)
        per_token = np.full(num_tokens, -1, dtype=np.int64)
        per_token[: len(row)] = req_slot[row]
        return LoRAMapping.build(per_token, self.device)

    def execute(self, scheduled: list[ScheduledRequest]) -> StepOutput:
        """Run one step: float32 logits for the requests that sample, plus prompt-position logits where asked."""
        return self.submit(scheduled).result()

    @torch.inference_mode()
    def submit(self, scheduled: list[ScheduledRequest]) -> "PendingStep":
        """Start one step; ``result()`` of the returned object completes it (at once, unless ``submit_logits``
        left the logits in flight)."""
        # Decodes first (stable); with LoRA, then by adapter slot, so an adapter's tokens are contiguous runs in
        # slot order (the LoRA op can then slice its slot stacks instead of gathering them).
        # With recurrent state a fresh one-token chunk is a prefill: a decode op would read its slot's stale state.
        fresh = self.kv.state_slots is not None
        if self.lora is not None:
            slot_of = self.lora.activate(s.request.lora_int_id for s in scheduled if s.request.lora_int_id)
            batch = sorted(scheduled, key=lambda s: (_not_decode(s, fresh), slot_of.get(s.request.lora_int_id, -1)))
        else:
            batch = sorted(scheduled, key=lambda s: _not_decode(s, fresh))
        input_ids, positions, meta = self.prepare(batch)
        if self.encoder_runner is not None and self.encoder_runner.prepare(batch, meta):
            # image rows ride in meta.extra, which graph and static runners do not carry: this step runs eagerly
            return self.encoder_runner.eager(self, lambda: self._submit_prepared(batch, input_ids, positions, meta))
        return self._submit_prepared(batch, input_ids, positions, meta)

    def _submit_prepared(self, batch: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor,
                         meta: AttentionMetadata) -> "PendingStep":
        out = StepOutput()
        if self.pooler is not None and any(s.request.pooling_params is not None for s in batch):
            return self._pool(batch, input_ids, positions, meta, out)
        rows = [i for i, s in enumerate(batch) if s.samples]
        spec = any(batch[i].spec_token_ids for i in rows)
        if (self.sample is not None and rows and not spec and not self.keep_hidden
                and all(on_device_eligible(batch[i]) for i in rows)
                and not any(s.request.prompt_logprobs is not None for s in batch)):
            # Forward, logits and sampling in the backend's region; the index and parameter rows are padded to
            # the sequence bucket like everything else.
            n = meta.seq_lens.shape[0]
            last = [meta.query_start_loc_cpu[i + 1] - 1 for i in rows]
            idx = torch.tensor(last + [0] * (n - len(rows)), dtype=torch.long, device=self.device)
            reqs = [batch[i].request for i in rows]
            tokens = self.sample(input_ids, positions, meta, idx, SamplingTensors.build(reqs, n, self.device))
            out.requests = reqs
            ids = tokens[:len(rows)].tolist()
            out.sampled = SamplerOutput(ids, [None] * len(ids), [0.0] * len(ids))
            return PendingStep(out)
        spans = list(prompt_logit_spans(batch, meta.query_start_loc_cpu))
        idx: list[int] = []
        if rows:
            qsl = meta.query_start_loc_cpu
            if spec:  # a speculative row verifies its proposals: logits at the last real token and each proposal
                out.num_logits = [1 + len(batch[i].spec_token_ids) for i in rows]
                out.spec_token_ids = [batch[i].spec_token_ids for i in rows]
                idx = [j for i, c in zip(rows, out.num_logits) for j in range(qsl[i + 1] - c, qsl[i + 1])]
            else:
                idx = [qsl[i + 1] - 1 for i in rows]
            out.requests = [batch[i].request for i in rows]
        num_sampled = len(idx)
        for _, _, start, stop in spans:
            idx.extend(range(start, stop))
        if self.keep_hidden:  # EAGLE reads the target's hidden rows (single rank: speculation refuses TP/PP)
            hidden = self.run(input_ids, positions, meta)
            out.hidden = hidden
            out.hidden_spans = [(s.request, s.num_computed_tokens, meta.query_start_loc_cpu[i], s.num_new_tokens,
                                 len(s.spec_token_ids)) for i, s in enumerate(batch)]
            logits = logits_of(self.model, hidden, idx)
        elif self.submit_logits is not None:
            return PendingStep(out, self.submit_logits(input_ids, positions, meta, idx), num_sampled, spans)
        else:
            logits = self.forward_logits(input_ids, positions, meta, idx)
        return PendingStep(out, lambda: logits, num_sampled, spans)

    def _pool(self, batch: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata, out: "StepOutput") -> "PendingStep":
        """A step with pooling requests: one forward; each pooling request's rows fed to its pooling state (chunked
        prefill accumulates across steps) and its pooled tensor once its prompt completes here; generation requests
        of the same step (a pooling engine whose model has an LM head also generates) get their logits as usual."""
        qsl = meta.query_start_loc_cpu
        if any(s.request.token_type_ids is not None for s in batch):  # BERT segments: meta.extra, per step token
            types = np.zeros(input_ids.shape[0], dtype=np.int64)
            for i, s in enumerate(batch):
                t = s.request.token_type_ids
                if t is not None:
                    types[qsl[i]:qsl[i + 1]] = t[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens]
            meta.extra["token_type_ids"] = torch.from_numpy(types).to(self.device)
        hidden = self.run(input_ids, positions, meta)
        idx: list[int] = []
        for i, s in enumerate(batch):
            r = s.request
            if r.pooling_params is None:  # a generation request
                if s.samples:
                    out.requests.append(r)
                    idx.append(qsl[i + 1] - 1)
                continue
            r.pooling_state.add(hidden[qsl[i]:qsl[i + 1]], s.num_computed_tokens, r.num_prompt_tokens)
            if s.samples:
                out.pooled.append((r, self.pooler.finish(r.pooling_state, r.pooling_params)))
        num_sampled = len(idx)
        spans = list(prompt_logit_spans(batch, qsl))
        for _, _, start, stop in spans:
            idx.extend(range(start, stop))
        logits = logits_of(self.model, hidden, idx)
        return PendingStep(out, lambda: logits, num_sampled, spans)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       idx: list[int]) -> Optional[torch.Tensor]:
        """The forward, then float32 logits of hidden rows ``idx`` (None if none). A distributed executor replaces
        it on the driver (``executor/``): every rank runs the same step from one broadcast."""
        return logits_of(self.model, self.run(input_ids, positions, meta), idx)


def logits_of(model: Any, hidden: torch.Tensor, idx: list[int]) -> Optional[torch.Tensor]:
    """``model.compute_logits`` of rows ``idx`` of ``hidden``, in float32 (None when ``idx`` is empty)."""
    if not idx:
        return None
    rows = torch.tensor(idx, dtype=torch.long, device=hidden.device)
    return model.compute_logits(hidden.index_select(0, rows)).float()


@dataclass
class PendingStep:
    """A submitted step: ``result()`` waits for its logits (if still in flight) and hands them out by request."""

    out: "StepOutput"
    wait: Optional[Callable[[], Optional[torch.Tensor]]] = None  # None: ``out`` is complete
    num_sampled: int = 0  # leading logits rows that are sampled; the prompt-logprob spans follow
    spans: list = field(default_factory=list)

    @torch.inference_mode()
    def result(self) -> "StepOutput":
        out = self.out
        if self.wait is None:
            return out
        logits, self.wait = self.wait(), None
        if out.requests:
            out.logits = logits[:self.num_sampled]
        off = self.num_sampled
        for r, lo, start, stop in self.spans:
            out.prompt_logits.append((r, lo, logits[off:off + stop - start]))
            off += stop - start
        return out


@dataclass
class StepOutput:
    requests: list[Request] = field(default_factory=list)  # requests that sample this step
    logits: Optional[torch.Tensor] = None  # [len(requests), vocab] float32
    prompt_logits: list[tuple[Request, int, torch.Tensor]] = field(default_factory=list)  # (req, first pos, logits)
    sampled: Optional[SamplerOutput] = None  # set when the backend sampled on the device (logits stay None)
    # Speculative steps: logits rows per request (1 + its proposals; None = one each) and the proposals.
    num_logits: Optional[list[int]] = None
    spec_token_ids: Optional[list[list[int]]] = None
    # With ``ModelRunner.keep_hidden``: the step's hidden states and (request, first position, first row, rows,
    # proposals) of each scheduled request.
    hidden: Optional[torch.Tensor] = None
    hidden_spans: Optional[list[tuple[Request, int, int, int, int]]] = None
    # The pooling runner: (request, pooled tensor on the host) of each request whose prompt completed this step
    pooled: list[tuple[Request, torch.Tensor]] = field(default_factory=list)
