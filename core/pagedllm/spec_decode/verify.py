"""Turn a speculative step's logits into emitted tokens: plain rows through the Sampler, speculative rows through
the rejection sampler (greedy rule or exact random verification against the processed target distribution)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from pagedllm.sample.greedy import greedy_token_ids
from pagedllm.sched.request import Request
from pagedllm.sample.sampler import Sampler, SamplerOutput
from pagedllm.spec_decode.rejection_sampler import greedy_verify, rejection_sample


def verify(sampler: Sampler, logits: torch.Tensor, reqs: Sequence[Request], num_logits: Sequence[int],
           proposals: Sequence[Sequence[int]]) -> SamplerOutput:
    """``logits`` [sum(num_logits), V]: request i owns ``num_logits[i]`` consecutive rows (its last real token, then
    each proposal). Rows with no proposal sample as usual (logprobs included); speculative requests are only those
    the planner found eligible (no logprobs, penalties or logits processors)."""
    starts = [0]
    for c in num_logits:
        starts.append(starts[-1] + c)
    n = len(reqs)
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list = [None] * n
    sampled_lp = [0.0] * n
    plain = [i for i in range(n) if num_logits[i] == 1]
    if plain:
        rows = torch.tensor([starts[i] for i in plain], dtype=torch.long, device=logits.device)
        out = sampler(logits.index_select(0, rows), [reqs[i] for i in plain])
        for j, i in enumerate(plain):
            tokens[i] = [out.token_ids[j]]
            logprobs[i], sampled_lp[i] = out.logprobs[j], out.sampled_logprob[j]
    greedy = [i for i in range(n) if num_logits[i] > 1 and reqs[i].params.greedy]
    if greedy:
        argmax = greedy_token_ids(logits).tolist()
        for i in greedy:
            tokens[i] = greedy_verify(proposals[i], argmax[starts[i]:starts[i + 1]])
    rand = [i for i in range(n) if num_logits[i] > 1 and not reqs[i].params.greedy]
    if rand:
        k = max(num_logits[i] for i in rand) - 1
        row_reqs = [reqs[i] for i in rand for _ in range(num_logits[i])]
        idx = torch.tensor([r for i in rand for r in range(starts[i], starts[i + 1])], dtype=torch.long,
                           device=logits.device)
        probs = Sampler.processed_logits(logits.index_select(0, idx), row_reqs).softmax(dim=-1)
        target = probs.new_zeros(len(rand), k + 1, probs.shape[-1])
        drafts = torch.zeros(len(rand), k, dtype=torch.long)
        off = 0
        for j, i in enumerate(rand):
            c = num_logits[i]
            target[j, :c] = probs[off:off + c]
            drafts[j, :c - 1] = torch.tensor(proposals[i], dtype=torch.long)
            off += c
        out_r = rejection_sample(drafts, [num_logits[i] - 1 for i in rand], target, None,
                                 [reqs[i].generator for i in rand])
        for j, i in enumerate(rand):
            tokens[i] = out_r[j]
    return SamplerOutput([t[-1] for t in tokens], logprobs, sampled_lp, spec_token_ids=tokens)


def sample_rows(num_logits: Optional[Sequence[int]], rows: Sequence[int]) -> list[int]:
    """Logits row of each request's last real token (where a grammar bitmask or plain sampling applies)."""
    if num_logits is None:
        return list(rows)
    starts = [0]
    for c in num_logits:
        starts.append(starts[-1] + c)
    return [starts[r] for r in rows]


def verified_spans(step: Any, sampled: Optional[SamplerOutput]) -> list[tuple[Request, int, int, int]]:
    """``(request, first position, first hidden row, rows)`` of the step's positions whose input tokens stand:
    every scheduled token but the rejected proposals (the features an EAGLE head reads)."""
    accepted: dict[str, int] = {}
    if sampled is not None and sampled.spec_token_ids is not None:
        accepted = {r.request_id: len(t) - 1 for r, t in zip(step.requests, sampled.spec_token_ids)}
    return [(r, pos, row, n - n_prop + accepted.get(r.request_id, 0) if n_prop else n)
            for r, pos, row, n, n_prop in step.hidden_spans]
