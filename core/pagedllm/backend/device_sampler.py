"""Sampling that can run inside a captured or compiled region: fixed shapes, no host synchronisation.

Static-shape devices (``Capabilities.on_device_sampling``) sample in the same region as the forward, as
compiled-graph engines do, so a step costs one launch and no logits leave the device. Only what needs no per-request host
state runs here — greedy, temperature, top-k, top-p, min-p; rows that ask for logprobs, penalties, seeds, min_tokens,
logit bias, allowed/bad words, a grammar or several samples per prompt go through the host sampler (``pagedllm.sample.sampler``), whose semantics this mirrors: greedy is
the same argmax, and random rows sample from the same filtered distribution (an exponential race instead of an
inverse CDF, so the draws differ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedllm.sched.scheduler import ScheduledRequest


def on_device_eligible(s: ScheduledRequest) -> bool:
    """True when the request's next token needs nothing the device sampler lacks."""
    r, p = s.request, s.request.params
    return (p.logprobs is None and p.seed is None and p.best_of == p.n and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and len(r.output_token_ids) >= p.min_tokens and r.structured is None and p.logit_bias is None
            and p.allowed_token_ids is None and not r.bad_words_token_ids)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, padded to the batch bucket (padding rows are greedy)."""

    temperature: torch.Tensor  # float32 [S]; 0 = greedy
    top_k: torch.Tensor  # int64 [S]; 0 = off
    top_p: torch.Tensor  # float32 [S]
    min_p: torch.Tensor  # float32 [S]

    @classmethod
    def build(cls, reqs: list, num_rows: int, device: torch.device) -> "SamplingTensors":
        pad = num_rows - len(reqs)
        ps = [r.params for r in reqs]
        temp = [0.0 if p.greedy else float(p.temperature) for p in ps] + [0.0] * pad
        return cls(torch.tensor(temp, dtype=torch.float32, device=device),
                   torch.tensor([p.top_k for p in ps] + [0] * pad, dtype=torch.long, device=device),
                   torch.tensor([float(p.top_p) for p in ps] + [1.0] * pad, dtype=torch.float32, device=device),
                   torch.tensor([float(p.min_p) for p in ps] + [0.0] * pad, dtype=torch.float32, device=device))


def sample(logits: torch.Tensor, t: SamplingTensors, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``[S, V]`` float32 logits -> ``[S]`` int64 token ids, with vLLM's order temperature -> top-k -> top-p ->
    min-p; every row computes both the greedy and the random token and ``where`` picks (no data-dependent branch)."""
    greedy = logits.argmax(-1)
    vocab = logits.shape[-1]
    x = logits / t.temperature.clamp(min=1e-5).unsqueeze(1)
    sorted_x, order = x.sort(-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(t.top_k > 0, t.top_k, torch.full_like(t.top_k, vocab)).unsqueeze(1)
    keep = ranks < k
    probs = sorted_x.masked_fill(~keep, float("-inf")).softmax(-1)
    keep &= (probs.cumsum(-1) - probs) < t.top_p.unsqueeze(1)  # the nucleus, always >= 1 token
    probs = sorted_x.masked_fill(~keep, float("-inf")).softmax(-1)
    keep &= probs >= t.min_p.unsqueeze(1) * probs[:, :1]
    probs = sorted_x.masked_fill(~keep, float("-inf")).softmax(-1)
    race = probs / torch.empty_like(probs).exponential_(generator=generator)
    picked = order.gather(1, race.argmax(-1, keepdim=True)).squeeze(1)
    return torch.where(t.temperature > 0, picked, greedy)
