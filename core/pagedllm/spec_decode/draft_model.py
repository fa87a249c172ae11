"""Draft-model proposer: a second (smaller) model with its own paged KV cache over the SAME block ids.

The target's block table already covers the step's lookahead slots, so the draft writes its K/V into its own cache
at the very slots the target uses: one block accounting for both (the pool is sized for the target; the draft's
cache is extra memory, ``num_blocks x`` its bytes per block). Each request remembers how many of its tokens have
draft K/V (``draft_num_computed``); a proposal step first catches the draft up (one prefill-like chunk), then runs
``k - 1`` single-token steps. Drafts are the draft's argmax (as vLLM v1's draft/EAGLE proposers), so verification
treats them as one-hot proposals, which keeps rejection sampling exact for any draft.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.sample.greedy import greedy_token_ids
from pagedllm.sched.kv_manager import KVCacheManager
from pagedllm.sched.request import Request


def draft_batch(active: Sequence[int], chunks: Sequence[Sequence[int]], starts: Sequence[int], tables: Any,
                block_size: int, device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor,
                                                               AttentionMetadata]:
    """One proposal step's batch over requests ``active`` (each feeding ``chunks[i]`` from position ``starts[i]``
    through block table ``tables[i]``): (their order, decodes first like the target's batch; input ids;
    positions; attention metadata)."""
    order = sorted(active, key=lambda i: len(chunks[i]) != 1)
    ids, pos, qlens, seq_lens = [], [], [], []
    for i in order:
        ids.extend(chunks[i])
        pos.extend(range(starts[i], starts[i] + len(chunks[i])))
        qlens.append(len(chunks[i]))
        seq_lens.append(starts[i] + len(chunks[i]))
    meta = AttentionMetadata.build(qlens, seq_lens, [tables[i] for i in order], block_size, device=device)
    return (order, torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(pos, dtype=torch.long, device=device), meta)


class DraftModelProposer:
    def __init__(self, model: Any, kv: KVCacheManager, device: torch.device):
        self.model, self.kv, self.device = model, kv, device

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """Up to ``ks[i]`` argmax drafts for each request (which is decoding: every token but the last computed)."""
        bs = self.kv.block_size
        tables = [self.kv.block_ids(r.request_id) for r in reqs]
        out: list[list[int]] = [[] for _ in reqs]
        # Step 0: catch up from draft_num_computed to the last real token; later steps feed the previous draft.
        chunks = [r.all_token_ids[min(r.draft_num_computed, r.num_tokens - 1):] for r in reqs]
        starts = [r.num_tokens - len(c) for r, c in zip(reqs, chunks)]
        active = list(range(len(reqs)))
        for j in range(max(ks, default=0)):
            active = [i for i in active if ks[i] > j]
            if not active:
                break
            order, ids, pos, meta = draft_batch(active, chunks, starts, tables, bs, self.device)
            hidden = self.model(ids, pos, meta)
            last = torch.tensor(meta.query_start_loc_cpu[1:], dtype=torch.long, device=hidden.device) - 1
            toks = greedy_token_ids(self.model.compute_logits(hidden.index_select(0, last))).tolist()
            for i, t in zip(order, toks):
                out[i].append(t)
                starts[i] += len(chunks[i])
                chunks[i] = [t]
        for r, o in zip(reqs, out):
            if o:  # K/V written for every real token and every draft but the last
                r.draft_num_computed = r.num_tokens + len(o) - 1
        return out
