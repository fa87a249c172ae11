"""Exact speculative verification (Leviathan et al. 2023; Chen et al. 2023; vLLM's ``RejectionSampler``).

Greedy rows accept drafts while they equal the target's argmax, then emit the target's token. Random rows accept
draft ``d`` at position ``j`` with probability ``min(1, p_j(d) / q_j(d))``; at the first rejection they emit a token
drawn from ``norm(max(p_j - q_j, 0))`` and stop; when every draft is accepted they emit a bonus token from ``p_k``.
The emitted tokens are then distributed exactly as if drawn from ``p`` one at a time. A proposer without a draft
distribution (n-gram, argmax drafts) passes ``draft_probs=None``: ``q`` is one-hot on the draft token. Seeded rows
draw every uniform from their own generator, so a request's tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def greedy_verify(draft: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Tokens to emit: the accepted prefix of ``draft`` plus the target's token after it (``len(target_argmax)``
    is ``len(draft) + 1``)."""
    out = []
    for d, t in zip(draft, target_argmax):
        out.append(t)
        if d != t:
            return out
    out.append(target_argmax[len(draft)])
    return out


def _uniforms(n: int, width: int, generators: Optional[Sequence[Optional[torch.Generator]]]) -> torch.Tensor:
    """[n, width] float64 uniforms in [0, 1); a row with a generator draws its own (``width`` per row)."""
    u = torch.rand(n, width, dtype=torch.float64)
    for i, g in enumerate(generators or ()):
        if g is not None:
            u[i] = torch.rand(width, dtype=torch.float64, generator=g)
    return u


def rejection_sample(draft_token_ids: torch.Tensor, num_draft: Sequence[int], target_probs: torch.Tensor,
                     draft_probs: Optional[torch.Tensor] = None,
                     generators: Optional[Sequence[Optional[torch.Generator]]] = None) -> list[list[int]]:
    """Random-sampling verification of a batch.

    ``draft_token_ids`` [B, K] (rows padded past ``num_draft[b]``); ``target_probs`` [B, K+1, V]: the target's
    (temperature/top-k/top-p processed) distribution at each draft position and the bonus position;
    ``draft_probs`` [B, K, V] or None (one-hot drafts). Returns, per row, the accepted drafts plus one token.
    """
    b, k = draft_token_ids.shape
    p = target_probs.double()
    dev = p.device
    nd = torch.tensor(list(num_draft), dtype=torch.long, device=dev)
    pos = torch.arange(k, device=dev)
    valid = pos.unsqueeze(0) < nd.unsqueeze(1)  # [B, K]
    drafts = draft_token_ids.to(dev).clamp(min=0)
    p_d = p[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, K]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = draft_probs.double().gather(2, drafts.unsqueeze(2)).squeeze(2)
    u = _uniforms(b, k + 1, generators).to(dev)
    accept = (u[:, :k] * q_d < p_d) & valid  # u < p/q without dividing (q > 0 wherever d was drawn from q)
    rejected = ~accept & valid
    # First rejected position, or num_draft when every draft is accepted.
    first = torch.where(rejected.any(1), rejected.float().argmax(1), nd)
    rows = torch.arange(b, device=dev)
    final_p = p[rows, first]  # [B, V]: the bonus distribution where all were accepted
    was_rejected = first < nd
    if bool(was_rejected.any()):
        if draft_probs is None:
            q_first = torch.zeros_like(final_p)
            q_first[rows, drafts[rows, first.clamp(max=k - 1)]] = 1.0
        else:
            q_first = draft_probs.double()[rows, first.clamp(max=k - 1)]
        residual = (final_p - q_first).clamp(min=0)
        ok = residual.sum(1) > 0  # a zero residual cannot be rejected into (p == q); keep p for safety
        use = was_rejected & ok
        final_p = torch.where(use.unsqueeze(1), residual, final_p)
    cdf = final_p.cumsum(1)
    target = (1.0 - u[:, k]) * cdf[:, -1]  # in (0, total]: never a zero-probability token
    last = torch.searchsorted(cdf, target.unsqueeze(1)).squeeze(1).clamp(max=p.shape[-1] - 1)
    first_l, last_l, drafts_l = first.tolist(), last.tolist(), draft_token_ids.tolist()
    return [drafts_l[i][:first_l[i]] + [last_l[i]] for i in range(b)]
