"""Iteration-level scheduler: one token budget per step, running requests first, then waiting ones.

As in vLLM v1 there is no separate prefill/decode phase: each request has ``num_computed_tokens`` and the step
gives it ``num_tokens - num_computed_tokens`` more (capped by the budget), which covers decode (1 token), chunked
prefill (a slice of the prompt) and recompute after preemption (everything again) with one rule. When the block
pool runs dry, the lowest-priority running request is preempted (blocks freed, recomputed later).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from pagedllm.kv_manager import KVCacheManager
from pagedllm.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int = 0  # before this step
    samples: bool = False  # this step reaches the request's last token, so its logits are sampled

    def __post_init__(self) -> None:
        r = self.request
        self.num_computed_tokens = r.num_computed_tokens
        self.samples = r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 policy: str = "fcfs"):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue -----------------------------------------------------------------------------------
    def _rank(self, req: Request) -> tuple:
        """Smaller runs first; the largest running rank is preempted first."""
        if self.policy == "priority":
            return (req.params.priority, req.arrival_time)
        return (req.arrival_time,)

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        if self.policy == "priority":
            self.waiting = deque(sorted(self.waiting, key=self._rank))

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.policy == "priority":
            self.running.sort(key=self._rank)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = max(self.running, key=self._rank)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # req itself was preempted: self.running shrank, i now points past the end
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        if out.preempted:  # admitting new work now would only thrash
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts once the model ran the step (before new tokens are appended)."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and give its blocks back."""
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        self.kv.free(req)

    def finish_all(self, reqs: Iterable[Request], status: RequestStatus) -> None:
        for r in list(reqs):
            self.finish(r, status)
