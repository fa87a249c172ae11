"""One distributed step, as every rank runs it from the driver's single broadcast.

The driver (rank 0) prepares the step's flat tensors once; the broadcast carries them — input ids, positions, the
attention metadata (block tables, slot mapping) and the hidden rows whose logits are wanted — so the other ranks need
no scheduler, KV manager or request state of their own. Under pipeline parallelism hidden states go stage to stage
by asynchronous send and the last stage sends the logits back to the driver, which does not wait for them inside the
step: the engine keeps up to ``pp`` steps (batches of disjoint requests) in flight, so stage 1 runs batch k while the
driver runs its stage of batch k + 1 (``LLMEngine``'s batch queue, vLLM's ``step_with_batch_queue``). With one batch
in flight at a time the step is instead cut into ``pp`` micro-batches of whole sequences (overlap within the step).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.worker.model_runner import logits_of


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    idx: list[int]  # rows (within this micro-batch) whose logits the driver samples from


def split_micro_batches(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, idx: list[int],
                        n: int) -> tuple[list[MicroBatch], list[int]]:
    """Cut a prepared step into at most ``n`` micro-batches of whole sequences with about equal token counts.
    Returns them and, for the logits they produce in order, the position each row has in ``idx``."""
    qsl, num_seqs = meta.query_start_loc_cpu, meta.num_seqs
    n = max(1, min(n, num_seqs))
    if n == 1:
        return [MicroBatch(input_ids, positions, meta, list(idx))], list(range(len(idx)))
    total = qsl[-1]
    cuts, s = [0], 0
    for k in range(1, n):  # first sequence boundary at or past k/n of the tokens, leaving a sequence for each rest
        target = total * k / n
        s = max(s + 1, cuts[-1] + 1)
        while s < num_seqs - (n - k) and qsl[s] < target:
            s += 1
        cuts.append(s)
    cuts.append(num_seqs)
    mbs, order = [], []
    for s0, s1 in zip(cuts, cuts[1:]):
        t0, t1 = qsl[s0], qsl[s1]
        sub_qsl = [q - t0 for q in qsl[s0:s1 + 1]]
        sub_lens = meta.seq_lens_cpu[s0:s1]
        dev = meta.query_start_loc.device
        sub = replace(meta, query_start_loc=torch.tensor(sub_qsl, dtype=torch.int32, device=dev),
                      seq_lens=meta.seq_lens[s0:s1], block_tables=meta.block_tables[s0:s1],
                      slot_mapping=meta.slot_mapping[t0:t1],
                      max_query_len=max(b - a for a, b in zip(sub_qsl, sub_qsl[1:])), max_seq_len=max(sub_lens),
                      num_decodes=max(0, min(meta.num_decodes, s1) - s0), query_start_loc_cpu=sub_qsl,
                      seq_lens_cpu=list(sub_lens), extra={})
        mine = [(k, j - t0) for k, j in enumerate(idx) if t0 <= j < t1]
        order.extend(k for k, _ in mine)
        mbs.append(MicroBatch(input_ids[t0:t1], positions[t0:t1], sub, [j for _, j in mine]))
    return mbs, order


def run_step(model: Any, par: Any, mbs: list[MicroBatch]) -> Callable[[], Optional[torch.Tensor]]:
    """Run this rank's part of one step now; returns what is left to wait for. On the driver that is the float32
    logits of every micro-batch's ``idx`` rows in micro-batch order (None where no row wants logits): under pipeline
    parallelism their receives from the last stage are only posted, so the driver can schedule and run its stage of
    the next batch while the later stages finish this one. Every rank's asynchronous sends are waited for in it too;
    other ranks' results return None."""
    driver = par.rank == 0
    if par.pp_size == 1:
        with torch.inference_mode():
            logits = logits_of(model, model(mbs[0].input_ids, mbs[0].positions, mbs[0].meta), mbs[0].idx)
        return lambda: logits if driver else None
    pp = par.pp_group
    recvs: list[Callable[[], torch.Tensor]] = []
    with torch.inference_mode():
        for mb in mbs:
            hidden_in = None
            if not par.is_first_stage:
                hidden_in = pp.recv((mb.input_ids.shape[0], model.hidden_size), model.dtype, par.pp_rank - 1)
            hidden = model(mb.input_ids, mb.positions, mb.meta, hidden=hidden_in)
            if not par.is_last_stage:
                pp.send(hidden, par.pp_rank + 1)
            elif mb.idx:
                logits = logits_of(model, hidden, mb.idx)  # tensor-parallel ranks of the stage gather the vocab
                if par.tp_rank == 0:
                    pp.send(logits, 0)
        if driver:
            vocab = model.vocab_size
            recvs = [pp.recv_async((len(mb.idx), vocab), torch.float32, par.pp_size - 1) for mb in mbs if mb.idx]
    sends = pp.detach_sends()

    def wait() -> Optional[torch.Tensor]:
        with torch.inference_mode():
            out = [r() for r in recvs]
            sends()
            return torch.cat(out) if out else None
    return wait
