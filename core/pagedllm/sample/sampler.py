"""Next-token sampling for a batch of requests, with vLLM's semantics and order of operations.

(grammar mask, applied before) -> allowed_token_ids -> bad_words -> logit_bias -> penalties -> min_tokens bans ->
(greedy argmax | temperature -> top_k -> top_p -> min_p -> sample).
Everything is vectorized across the batch; only rows that ask for top-k/top-p pay for a (partial) sort, an all-greedy
batch without penalties is a single argmax, and sampling is inverse-CDF (two-level, float64) with one uniform per row. Seeded rows draw
that uniform from their own ``torch.Generator``, so their tokens do not depend on the rest of the batch.
Logprobs are always those of the RAW model logits (vLLM v1's default ``raw_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from pagedllm.sample.greedy import greedy_token_ids
from pagedllm.outputs import Logprob
from pagedllm.sched.request import Request

_NEG_INF = float("-inf")
_CANDIDATES = 256  # tokens sorted for top-p first; rows whose nucleus is wider retry with more
_CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per request: None unless params.logprobs is set, else the sampled token + top-N (raw logprob, 1-based rank).
    logprobs: list[Optional[dict[int, Logprob]]]
    sampled_logprob: list[float]  # raw logprob of each sampled token (for cumulative_logprob); 0.0 when no row
    # of the batch reports logprobs or ranks samples by them
    # Speculative steps: every token each request emits this step (accepted drafts + one), else None.
    spec_token_ids: Optional[list[list[int]]] = None


def _rows(idx: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(idx, dtype=torch.long, device=device)


def _take_rows(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """``x[idx]`` without the copy when idx is every row (the common, homogeneous batch)."""
    return x if len(idx) == x.shape[0] else x[_rows(idx, x.device)]


def _update_rows(x: torch.Tensor, idx: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``x[idx] = fn(x[idx])``, in place and copy-free when idx is every row."""
    if len(idx) == x.shape[0]:
        out = fn(x)
        if out is not x:
            x.copy_(out)
    else:
        rows = _rows(idx, x.device)
        x[rows] = fn(x[rows])


def _padded(seqs: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(s) for s in seqs))
    return torch.tensor([list(s) + [pad] * (width - len(s)) for s in seqs], dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens only), in place.

    Repetition is HF/vLLM style: a seen token's logit is divided by the penalty if positive, multiplied if not.
    Frequency/presence is OpenAI's: ``logit -= frequency * count + presence * (count > 0)``.
    Works on the seen token ids only (gather/scatter), never on dense [batch, vocab] masks.
    """
    n, vocab = logits.shape
    dev = logits.device
    ext = torch.cat([logits, logits.new_zeros(n, 1)], dim=1)  # column `vocab` absorbs the padding
    ps = [r.params for r in reqs]
    if any(p.repetition_penalty != 1.0 for p in ps):
        seen = _padded([sorted(set(r.prompt_token_ids).union(r.output_token_ids)) for r in reqs], vocab, dev)
        rep = torch.tensor([float(p.repetition_penalty) for p in ps], device=dev).unsqueeze(1)
        v = ext.gather(1, seen)
        ext.scatter_(1, seen, torch.where(v > 0, v / rep, v * rep))
    if any(p.frequency_penalty != 0.0 for p in ps):
        out = _padded([r.output_token_ids for r in reqs], vocab, dev)
        freq = torch.tensor([float(p.frequency_penalty) for p in ps], device=dev).unsqueeze(1)
        ext.scatter_add_(1, out, (-freq).expand(out.shape))
    if any(p.presence_penalty != 0.0 for p in ps):
        uniq = _padded([sorted(set(r.output_token_ids)) for r in reqs], vocab, dev)
        pres = torch.tensor([float(p.presence_penalty) for p in ps], device=dev).unsqueeze(1)
        ext.scatter_add_(1, uniq, (-pres).expand(uniq.shape))
    return logits.copy_(ext[:, :vocab])


def top_k_top_p_cutoff(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       candidates: int = _CANDIDATES) -> torch.Tensor:
    """Per-row logit threshold [R]: tokens below it are outside the row's top-k or its top-p nucleus.

    ``top_k`` [R] long in [1, vocab] (vocab = disabled); ``top_p`` [R] float in (0, 1] (1 = disabled). The nucleus
    is the smallest set of most likely tokens whose mass reaches top_p, taken on the distribution left by top-k
    (vLLM/HF semantics; ties with the last kept value are kept). Only the best ``candidates`` tokens are sorted (a
    partial topk); rows whose nucleus is wider retry with 16x more, up to a full sort.
    """
    _, vocab = logits.shape
    k_on = top_k < vocab
    p_on = top_p < 1.0
    kmax = int(top_k[k_on].max()) if bool(k_on.any()) else 1
    width = min(vocab, max(kmax, candidates if bool(p_on.any()) else 1))
    vals = (logits.topk(width, dim=-1) if width < vocab else logits.sort(dim=-1, descending=True)).values
    neg_inf = torch.full_like(vals[:, 0], _NEG_INF)
    kth = torch.where(k_on, vals.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1)).squeeze(1), neg_inf)
    if not bool(p_on.any()):
        return kth
    top = vals[:, :1]
    w = (vals - top).exp() * (vals >= kth.unsqueeze(1))  # candidates' weights after top-k
    total = torch.where(k_on, w.sum(-1), (logits - top).exp().sum(-1))
    probs = w / total.unsqueeze(1)
    n_keep = ((probs.cumsum(-1) - probs) < top_p.unsqueeze(1)).sum(-1)  # the nucleus is a prefix, >= 1 token
    p_cut = torch.where(p_on, vals.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1), neg_inf)
    cutoff = torch.maximum(kth, p_cut)
    wider = p_on & ~k_on & (probs.sum(-1) < top_p)
    if width < vocab and bool(wider.any()):  # candidates short of top_p: retry those rows with 16x more
        rows = wider.nonzero().squeeze(1)
        cutoff[rows] = top_k_top_p_cutoff(logits[rows], top_k[rows], top_p[rows], candidates=width * 16)
    return cutoff


class Sampler:
    """``Sampler()(logits [len(reqs), vocab], reqs) -> SamplerOutput``; row i is reqs[i]'s next-token distribution."""

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> SamplerOutput:
        raw = logits.float()
        n, vocab = raw.shape
        dev = raw.device
        params = [r.params for r in reqs]
        pen = [i for i, p in enumerate(params)
               if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
        bans = self._min_tokens_bans(reqs, vocab)
        procs = [i for i, r in enumerate(reqs) if r.params.logit_bias or r.params.allowed_token_ids is not None
                 or r.bad_words_token_ids]
        # raw stays untouched: logprobs are raw, and it may be the caller's
        x = raw.clone() if (pen or bans or procs) else raw
        for i in procs:
            self._restrict(x[i], reqs[i])
        if pen:
            _update_rows(x, pen, lambda sub: apply_penalties(sub, [reqs[i] for i in pen]))
        if bans:
            x[_rows([b[0] for b in bans], dev), _rows([b[1] for b in bans], dev)] = _NEG_INF

        greedy = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy) == n:
            tokens = greedy_token_ids(x)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=dev)
            if greedy:
                tokens[_rows(greedy, dev)] = greedy_token_ids(_take_rows(x, greedy))
            rand = [i for i, p in enumerate(params) if not p.greedy]
            tokens[_rows(rand, dev)] = self._sample(_take_rows(x, rand), [reqs[i] for i in rand])
        return self._outputs(raw, tokens, reqs)

    @staticmethod
    def _restrict(row: torch.Tensor, r: Request) -> None:
        """vLLM's per-request logits processors, in its order: allowed_token_ids, bad_words, logit_bias."""
        p, vocab = r.params, row.shape[0]
        if p.allowed_token_ids is not None:
            keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long, device=row.device)
            kept = row[keep].clone()
            row.fill_(_NEG_INF)
            row[keep] = kept
        for word in r.bad_words_token_ids:  # ban a word's last token when the output already ends with the rest
            prefix = word[:-1]
            if not prefix or r.all_token_ids[-len(prefix):] == prefix:
                row[word[-1]] = _NEG_INF
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long, device=row.device)
            row[ids] += torch.tensor([float(p.logit_bias[t]) for t in p.logit_bias if t < vocab], device=row.device)

    @staticmethod
    def _min_tokens_bans(reqs: Sequence[Request], vocab: int) -> list[tuple[int, int]]:
        """(row, token) pairs to forbid: stop token ids (and EOS ids unless ignore_eos) while output < min_tokens."""
        bans = []
        for i, r in enumerate(reqs):
            p = r.params
            if len(r.output_token_ids) >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(getattr(r, "eos_token_ids", ()))
                if r.eos_token_id is not None:
                    banned.add(r.eos_token_id)
            bans.extend((i, t) for t in sorted(banned) if 0 <= t < vocab)
        return bans

    @staticmethod
    def _sample(x: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Temperature, then top-k/top-p/min-p as one logit threshold per row, then inverse-CDF sampling.

        min-p (probability < min_p * max probability) is the logit threshold ``max + log(min_p)``; the max survives
        top-k/top-p, so applying it after them is the same threshold. Each row needs one uniform: seeded rows draw
        it from their own generator (so batch composition cannot change their tokens), the rest share one draw.
        """
        n, vocab = x.shape
        dev = x.device
        x = Sampler.processed_logits(x, reqs)
        seeded = [i for i, r in enumerate(reqs) if r.generator is not None]
        u = torch.rand(n, dtype=torch.float64, device=dev) if len(seeded) < n else \
            torch.empty(n, dtype=torch.float64, device=dev)
        for i in seeded:  # drawn on the generator's own device: same tokens whatever the batch or device
            gen = reqs[i].generator
            u[i] = torch.rand(1, dtype=torch.float64, device=gen.device, generator=gen).to(dev)
        return inverse_cdf_sample(x.softmax(dim=-1), u)

    @staticmethod
    def processed_logits(x: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """``x`` after temperature and the top-k/top-p/min-p threshold (a copy, or ``x`` itself when none of them
        changes it): softmax of it is the distribution a random row samples from (speculative verification needs it
        as probabilities)."""
        n, vocab = x.shape
        dev = x.device
        params = [r.params for r in reqs]
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        cut = [i for i, p in enumerate(params) if ks[i] < vocab or p.top_p < 1.0]
        use_min_p = any(p.min_p > 0.0 for p in params)
        if any(p.temperature != 1.0 for p in params):
            x = x / torch.tensor([float(p.temperature) for p in params], device=dev).unsqueeze(1)  # a private copy
        elif cut or use_min_p:
            x = x.clone()  # masked below, in place
        if cut or use_min_p:
            cutoff = torch.full((n,), _NEG_INF, device=dev)
            if cut:
                kp = top_k_top_p_cutoff(_take_rows(x, cut), _rows([ks[i] for i in cut], dev),
                                        torch.tensor([float(params[i].top_p) for i in cut], device=dev))
                if len(cut) == n:
                    cutoff = kp
                else:
                    cutoff[_rows(cut, dev)] = kp
            if use_min_p:
                min_p = torch.tensor([float(p.min_p) for p in params], device=dev)
                cutoff = torch.maximum(cutoff, x.amax(dim=-1) + min_p.log())
            cut_set = set(cut)
            masked = [i for i, p in enumerate(params) if i in cut_set or p.min_p > 0.0]
            thresh = _take_rows(cutoff.unsqueeze(1), masked)
            _update_rows(x, masked, lambda sub: sub.masked_fill_(sub < thresh, _NEG_INF))
        return x

    @staticmethod
    def _outputs(raw: torch.Tensor, tokens: torch.Tensor, reqs: Sequence[Request]) -> SamplerOutput:
        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        logprobs: list[Optional[dict[int, Logprob]]] = [None] * len(reqs)
        # Logprobs cost a full-vocab log_softmax per row: only for rows that report them or rank by them (best_of).
        if not lp_rows and all(r.params.best_of == r.params.n for r in reqs):
            return SamplerOutput(tokens.tolist(), logprobs, [0.0] * len(reqs))
        all_lps = raw.log_softmax(dim=-1)  # (faster than logsumexp on CPU)
        sampled = all_lps.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if lp_rows:
            entries = logprob_entries(_take_rows(all_lps, lp_rows), _take_rows(tokens, lp_rows),
                                      [reqs[i].params.logprobs for i in lp_rows])
            for i, d in zip(lp_rows, entries):
                logprobs[i] = d
        return SamplerOutput(tokens.tolist(), logprobs, sampled.tolist())


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor, block: int = _CDF_BLOCK) -> torch.Tensor:
    """Per row of ``probs`` [R, V] (unnormalized is fine) the token whose CDF interval holds ``(1 - u) * total``.

    Two levels, so that no [R, V] float64 copy or full-vocab cumsum is made (those dominated large-n steps): the
    float64 CDF of per-block masses picks a block, then the float64 CDF of that block's ``block`` probabilities picks
    the token, at the same position within the block. The same uniform picks the same token as a flat float64 CDF
    (up to rounding at interval edges), tail tokens keep their mass, and a zero-probability token is never chosen:
    the target is > 0 within the block and ``searchsorted`` returns the first token whose CDF reaches it.
    """
    n, vocab = probs.shape
    nb = -(-vocab // block)
    if nb * block != vocab:
        probs = torch.cat([probs, probs.new_zeros(n, nb * block - vocab)], dim=1)
    blocks = probs.view(n, nb, block)
    mass = blocks.sum(dim=-1).double()  # [R, nb]
    cdf = mass.cumsum(dim=-1)
    target = (1.0 - u.to(cdf.dtype)) * cdf[:, -1]  # in (0, total]
    b = torch.searchsorted(cdf, target.unsqueeze(1)).squeeze(1).clamp_(max=nb - 1)
    b1 = b.unsqueeze(1)
    before = torch.cat([cdf.new_zeros(n, 1), cdf], dim=1).gather(1, b1).squeeze(1)  # < target: b is the first
    frac = ((target - before) / mass.gather(1, b1).squeeze(1)).clamp_(max=1.0)  # in (0, 1]
    inner = blocks[torch.arange(n, device=probs.device), b].double().cumsum(dim=-1)  # [R, block]
    t = torch.searchsorted(inner, (frac * inner[:, -1]).unsqueeze(1)).squeeze(1).clamp_(max=block - 1)
    return (b * block + t).clamp_(max=vocab - 1)


def logprob_entries(lps: torch.Tensor, tokens: torch.Tensor, nums: Sequence[int]) -> list[dict[int, Logprob]]:
    """Per row of log-probabilities ``lps`` [R, V]: {token: Logprob(value, rank)} for the chosen token (rank 1 =
    most likely) plus the row's top ``nums[r]`` tokens — vLLM's shape for sample and prompt logprobs alike."""
    tok_lp = lps.gather(1, tokens.view(-1, 1).to(lps.device))
    top_n = max(nums, default=0)
    top_vals, top_ids = lps.topk(top_n, dim=-1) if top_n else (lps[:, :0], lps[:, :0].long())
    ranks = _ranks(lps, tok_lp, top_vals)
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out = []
    for tok, lp, rank, num, vals, ids in zip(tokens.tolist(), tok_lp[:, 0].tolist(), ranks, nums, top_vals, top_ids):
        d = {tok: Logprob(lp, rank)}
        for k in range(num):
            if ids[k] not in d:
                d[ids[k]] = Logprob(vals[k], k + 1)
        out.append(d)
    return out


def _ranks(lps: torch.Tensor, tok_lp: torch.Tensor, top_vals: torch.Tensor) -> list[int]:
    """1 + how many tokens are strictly more likely than the chosen one, per row. A row whose token is among its
    top values counts within them; the others take one full pass, as a 0/1 float sum (exact below 2**24 tokens,
    and about 3x faster on CPU than summing a bool mask)."""
    ranks = torch.ones(lps.shape[0], dtype=torch.long, device=lps.device)
    if top_vals.shape[1]:
        inside = tok_lp[:, 0] >= top_vals[:, -1]
        ranks += (top_vals > tok_lp).sum(dim=-1)
    else:
        inside = torch.zeros_like(ranks, dtype=torch.bool)
    if not bool(inside.all()):
        rows = (~inside).nonzero().squeeze(1)
        # a few rows: count on copies of those; many: count on every row (no copy) and keep the ones needed
        sub, t = (lps.index_select(0, rows), tok_lp[rows]) if 4 * len(rows) < lps.shape[0] else (lps, tok_lp)
        counted = (sub - t).gt_(0).sum(dim=-1).long() + 1  # -inf - -inf is nan, and nan > 0 is False, as it should
        ranks[rows] = counted if sub is not lps else counted[rows]
    return ranks.tolist()
