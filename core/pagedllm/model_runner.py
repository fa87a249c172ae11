"""Turns one scheduled step into flat device tensors, runs the model, and returns logits for sampling rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.kv_manager import KVCacheManager
from pagedllm.request import Request
from pagedllm.scheduler import ScheduledRequest


class ModelRunner:
    def __init__(self, model: Any, run: Any, kv: KVCacheManager, device: torch.device):
        self.model = model
        self.run = run  # the backend's graph runner callable: run(input_ids, positions, meta) -> hidden
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size

    def prepare(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        qlens = np.fromiter((s.num_new_tokens for s in batch), dtype=np.int64, count=len(batch))
        starts = np.fromiter((s.num_computed_tokens for s in batch), dtype=np.int64, count=len(batch))
        seq_lens = starts + qlens
        tables = [self.kv.block_ids(s.request.request_id) for s in batch]
        width = max(len(t) for t in tables)
        bt = np.zeros((len(batch), width), dtype=np.int32)
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
            row = np.repeat(np.arange(len(batch)), qlens)
            pos = np.arange(int(qlens.sum())) - np.repeat(np.cumsum(qlens) - qlens, qlens) + starts[row]
        slots = bt[row, pos // bs].astype(np.int64) * bs + pos % bs
        qsl = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        num_decodes = int(np.argmax(qlens != 1)) if (qlens != 1).any() else len(batch)
        dev = self.device
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
        )
        input_ids = torch.tensor(tokens, dtype=torch.long).to(dev)
        positions = torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64)).to(dev)
        return input_ids, positions, meta

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> StepOutput:
        """Run one step: float32 logits for the requests that sample, plus prompt-position logits where asked."""
        batch = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)  # decodes first (stable)
        input_ids, positions, meta = self.prepare(batch)
        hidden = self.run(input_ids, positions, meta)
        out = StepOutput()
        rows = [i for i, s in enumerate(batch) if s.samples]
        if rows:
            last = torch.tensor([meta.query_start_loc_cpu[i + 1] - 1 for i in rows], dtype=torch.long,
                                device=hidden.device)
            out.requests = [batch[i].request for i in rows]
            out.logits = self.model.compute_logits(hidden.index_select(0, last)).float()
        for i, s in enumerate(batch):
            r = s.request
            if r.prompt_logprobs is None:
                continue
            # Position p's logits predict token p + 1: prompt tokens 1..P-1 need positions 0..P-2, once each.
            lo = max(s.num_computed_tokens, len(r.prompt_logprobs) - 1)
            hi = min(s.num_computed_tokens + s.num_new_tokens, r.num_prompt_tokens - 1)
            if lo < hi:
                base = meta.query_start_loc_cpu[i] - s.num_computed_tokens
                out.prompt_logits.append((r, lo, self.model.compute_logits(hidden[base + lo:base + hi]).float()))
        return out


@dataclass
class StepOutput:
    requests: list[Request] = field(default_factory=list)  # requests that sample this step
    logits: Optional[torch.Tensor] = None  # [len(requests), vocab] float32
    prompt_logits: list[tuple[Request, int, torch.Tensor]] = field(default_factory=list)  # (req, first pos, logits)
