"""The engine's speculative decoding: which requests speculate and how far, proposals, bookkeeping and stats.

Per step: ``plan`` (before scheduling) gives each decoding request its lookahead; the scheduler reserves those
slots; ``propose`` fills them; the worker verifies; ``accept`` records the outcome, rolls back rejected slots and
throttles. Throttle: a request whose acceptance rate (EMA) falls below ``acceptance_threshold`` pauses for 2, 4, ..
64 steps (doubling while it stays low), so unpredictable text costs few wasted verification tokens; a good
verification ends the back-off. With ``disable_by_batch_size`` set, no request speculates while that many run
(vLLM v0); unset, the measured batch throttle (throttle.py) turns speculation off at batch sizes where it does not
pay. That throttle depends on timing, so seeded requests (whose tokens depend on which steps verify drafts) are
left out of it and stay reproducible.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pagedllm.sched.request import Request
from pagedllm.sched.scheduler import ScheduledRequest
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.throttle import BatchThrottle

_MAX_BACKOFF = 64


@dataclass
class SpecDecodeStats:
    """vLLM v1's counters: drafts (verifications), draft tokens proposed, accepted; per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification (accepted drafts + the target's own), vLLM's definition."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def eligible(req: Request, ignore_min_tokens: bool = False) -> bool:
    """Requests whose next tokens do not depend on per-token host state the verifier does not replay: no logprobs
    (and no best_of ranking), penalties, logits processors, grammar or pending min_tokens ban."""
    p = req.params
    return (p.logprobs is None and req.prompt_logprobs is None and p.best_of == p.n
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and not p.logit_bias and p.allowed_token_ids is None and not req.bad_words_token_ids
            and req.structured is None and (ignore_min_tokens or req.num_output_tokens >= p.min_tokens))


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: Any = None):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.ngram = (NgramProposer(self.k, config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        self.draft = draft  # DraftModelProposer for method draft_model
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self.throttle: Optional[BatchThrottle] = BatchThrottle() if config.disable_by_batch_size is None else None
        self._step_start = 0.0

    def _budget(self, req: Request) -> int:
        """Most proposals worth verifying: every emitted token must fit max_tokens and max_model_len."""
        return max(0, min(self.k, req.max_tokens - req.num_output_tokens - 1,
                          self.max_model_len - req.num_tokens - 1))

    def plan(self, running: Sequence[Request]) -> None:
        """Set each running request's lookahead for the coming step (n-gram proposals are found now, so a request
        without a match reserves nothing)."""
        self._step_start = time.perf_counter()
        dbs = self.config.disable_by_batch_size
        off = bool(dbs) and len(running) >= dbs
        for r in running:
            r.num_lookahead, r.spec_token_ids = 0, []
        if self.throttle is not None:
            self.throttle.cancel()
        cands = [] if off else [r for r in running if r.num_tokens - r.num_computed_tokens == 1 and eligible(r)]
        # The measured throttle is asked only when an unseeded request could speculate now (so steps that cannot
        # speculate anyway are not charged to either side).
        measured_off = (self.throttle is not None
                        and any(r.params.seed is None and r.spec_skip == 0 for r in cands)
                        and not self.throttle.allow(len(running)))
        for r in cands:
            if measured_off and r.params.seed is None:
                continue
            if r.spec_skip > 0:
                r.spec_skip -= 1
                continue
            k = self._budget(r)
            if k and self.ngram is not None:
                r.spec_token_ids = self.ngram.propose(r.all_token_ids, k)
                k = len(r.spec_token_ids)
            r.num_lookahead = k

    def propose(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Fill the reserved lookahead slots of this step's speculating requests."""
        spec = [s for s in scheduled if s.num_lookahead > 0]
        if hasattr(self.draft, "flush"):  # EAGLE: bound the features kept for requests that do not speculate
            self.draft.flush([s.request for s in scheduled if s.num_lookahead == 0])
        if not spec:
            return
        if self.ngram is not None:
            for s in spec:
                s.set_proposals(s.request.spec_token_ids)
            return
        drafts = self.draft.propose([s.request for s in spec], [s.num_lookahead for s in spec])
        for s, d in zip(spec, drafts):
            s.set_proposals(d)

    def end_step(self, num_tokens: int, decode_only: bool) -> None:
        """Report the step's emitted tokens to the batch throttle (time since ``plan``)."""
        if self.throttle is not None:
            self.throttle.observe(num_tokens, time.perf_counter() - self._step_start, decode_only)

    def accept(self, req: Request, num_proposed: int, num_accepted: int) -> None:
        """Record one verification and update the request's throttle (call before its tokens are appended)."""
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += num_proposed
        st.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            st.accepted_per_pos[j] += 1
        rate = num_accepted / num_proposed
        req.spec_acceptance = 0.5 * req.spec_acceptance + 0.5 * rate
        if req.spec_acceptance < self.config.acceptance_threshold:
            req.spec_backoff = min(max(2, 2 * req.spec_backoff), _MAX_BACKOFF)
            req.spec_skip = req.spec_backoff
            req.spec_acceptance = self.config.acceptance_threshold  # the probe after the pause starts neutral
        elif rate >= self.config.acceptance_threshold:
            req.spec_backoff = 0
        if self.draft is not None:  # draft K/V is valid up to the last accepted draft
            req.draft_num_computed = min(req.draft_num_computed, req.num_tokens + num_accepted)


def build(config: Optional[SpeculativeConfig], max_model_len: int, draft: Any = None) -> Optional[SpecDecoder]:
    return SpecDecoder(config, max_model_len, draft) if config is not None else None
