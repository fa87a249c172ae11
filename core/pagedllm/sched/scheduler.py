"""Iteration-level scheduler: one token budget per step, running requests first, then waiting ones.

As in vLLM v1 there is no separate prefill/decode phase: each request has ``num_computed_tokens`` and the step
gives it ``num_tokens - num_computed_tokens`` more (capped by the budget), which covers decode (1 token), chunked
prefill (a slice of the prompt) and recompute after preemption (everything again) with one rule. When the block
pool runs dry, the lowest-priority running request is preempted (blocks freed, recomputed later).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import chain
from typing import Optional

from pagedllm.multimodal.encoder_cache import EncoderCacheManager, free_computed_inputs, schedule_encoder_inputs
from pagedllm.multimodal.prefix_lm import trim_hits, whole_spans
from pagedllm.sched.kv_manager import BlockPool, KVCacheManager
from pagedllm.sched.request import Request, RequestStatus


SHARED_ROWS_PER_REQUEST = 16


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int = 0  # before this step
    samples: bool = False  # this step reaches the request's last token, so its logits are sampled
    num_lookahead: int = 0  # speculative slots reserved after the last token (num_new_tokens includes them)
    spec_token_ids: list[int] = field(default_factory=list)  # proposals filling those slots (<= num_lookahead)
    encoder_inputs: list[int] = field(default_factory=list)  # indices of request.mm_features to encode this step

    def __post_init__(self) -> None:
        r = self.request
        self.num_computed_tokens = r.num_computed_tokens
        self.samples = r.num_computed_tokens + self.num_new_tokens >= r.num_tokens

    def set_proposals(self, token_ids: list[int]) -> None:
        """Fill the lookahead with (at most num_lookahead) proposals; unused slots drop out of the step."""
        self.spec_token_ids = list(token_ids[:self.num_lookahead])
        self.num_new_tokens = self.num_new_tokens - self.num_lookahead + len(self.spec_token_ids)
        self.num_lookahead = len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block), run before the model
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # Recurrent state of the requests swapped this step (sched/state_slots.py): (device slot, host slot) and back
    state_swap_out: list[tuple[int, int]] = field(default_factory=list)
    state_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled or self.swap_out)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 policy: str = "fcfs", swap: Optional[BlockPool] = None, max_loras: int = 0,
                 requires_kv_cache: bool = True):
        self.kv = kv
        # False: an encoder-only model (no KV cache): a request runs its whole prompt in one step, taking no blocks
        self.requires_kv_cache = requires_kv_cache
        self.swap = swap  # host block pool for swapped-out requests (None: recompute only)
        self.num_swaps = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.max_loras = max_loras  # distinct adapters running at once (0: LoRA off)
        # While other requests are active, one request's samples (its n / best_of children) take at most this many
        # rows of a step, rotating: the per-row work (sampling and logprobs over the vocabulary) of one client's
        # n=128 would otherwise make every other request's steps that much slower. Alone, it takes them all.
        self.max_rows_per_request = SHARED_ROWS_PER_REQUEST
        # Requests of batches still in flight (pipeline parallel: the engine's batch queue). They are not scheduled
        # again, nor preempted, until their batch's output returns (vLLM: batches of disjoint requests).
        self.in_flight: set[str] = set()
        # Multimodal models (pagedllm.multimodal): the encoder cache's accounting, and the encoder output tokens one
        # step may compute (vLLM's max_num_encoder_input_tokens); the engine sets both for a vision model.
        self.encoder_cache: Optional[EncoderCacheManager] = None
        self.max_num_encoder_input_tokens = max_num_batched_tokens
        self.encoder_budget = 0  # left in the step being scheduled
        # PrefixLM image spans (Gemma 3 with vision): chunks and prefix hits never end inside an image
        # (multimodal/prefix_lm.py); the engine sets it for such a model.
        self.mm_prefix_lm = False
        # A KV connector (kv_transfer.runtime.KVTransfer): loads prefix blocks the device cache lost, may keep a
        # finished request's blocks while it sends them (docs/kv-offload.md)
        self.connector = None

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

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_schedulable(self) -> int:
        """Requests a step could take now: waiting ones and running ones not in flight."""
        return len(self.waiting) + len(self.running) - len(self.in_flight.intersection(
            r.request_id for r in self.running))

    def mark_in_flight(self, out: SchedulerOutput) -> None:
        """The step's batch was submitted: its requests are neither scheduled again nor preempted until it returns."""
        self.in_flight.update(s.request.request_id for s in out.scheduled)

    def mark_returned(self, out: SchedulerOutput) -> None:
        """The step's batch returned (or failed): its requests may be scheduled again."""
        self.in_flight.difference_update(s.request.request_id for s in out.scheduled)

    def _preemptible(self) -> list[Request]:
        return [r for r in self.running if r.request_id not in self.in_flight]

    # ---- one step --------------------------------------------------------------------------------
    def _preempt(self, req: Request, out: SchedulerOutput, allow_swap: bool = True) -> None:
        """Free a running request's device blocks: swap them to host when that is cheaper, else recompute later.

        Cost rule: swapping moves each block twice (out and back in); recomputing reruns every computed token
        through the model. A request holding more than one block's worth of computed tokens is cheaper to swap
        whenever host space is there (a token's K/V is far fewer bytes than its forward pass is FLOPs).
        """
        self.running.remove(req)
        req.spec_token_ids, req.num_lookahead = [], 0
        blocks = self.kv.block_ids(req.request_id)
        state = self.kv.state_swap  # a model with state swaps the request's state slot with its blocks
        if (allow_swap and self.swap is not None and req.num_computed_tokens > self.kv.block_size
                and self.swap.num_free >= len(blocks)
                and (self.kv.state_slots is None or state is not None and state.can_swap_out())):
            if self.kv.state_slots is not None:
                out.state_swap_out.append(state.swap_out(req.request_id))
            host = [b.block_id for b in self.swap.take(len(blocks))]
            out.swap_out.extend(zip(blocks, host))
            req.swapped_blocks = host
            self.num_swaps += 1
        else:
            req.num_computed_tokens = 0
            req.draft_num_computed = 0  # (a swap moves the draft's K/V with the target's: worker.swap)
            if req.pooling_state is not None:  # its prompt is pooled again from the start
                req.pooling_state.reset()
        self.kv.free(req)
        if self.encoder_cache is not None:
            self.encoder_cache.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        if self.policy == "priority":
            self.waiting = deque(sorted(self.waiting, key=self._rank))
        out.preempted.append(req)

    def _admit(self, req: Request, out: SchedulerOutput, budget: int) -> int:
        """Try to start (or resume) the head waiting request; returns the tokens scheduled (0 = could not)."""
        enc: list[int] = []  # images to encode (multimodal)
        if not self.requires_kv_cache:  # the whole prompt in this step or not yet (the engine refused longer ones)
            n = req.num_tokens - req.num_computed_tokens
            if n > budget:
                return 0
        elif req.swapped_blocks is not None:
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            enc, n = self._encoder_inputs(req, req.num_computed_tokens, n)
            if n == 0 or not self.kv.allocate_slots(req, n):
                return self._unref_encoder_inputs(req)
            out.swap_in.extend(zip(req.swapped_blocks, self.kv.block_ids(req.request_id)))
            if self.kv.state_swap is not None:  # (allocate_slots gave it a device state slot)
                out.state_swap_in.extend(self.kv.state_swap.swap_in(req.request_id))
            self.swap.release([self.swap.blocks[h] for h in req.swapped_blocks])
            req.swapped_blocks = None
        else:
            # Prompt logprobs (and MEAN/CLS/ALL pooling) need every prompt position, so they skip the prefix cache.
            hits, num_hit = self.kv.get_computed_blocks(req) if not req.skip_prefix_cache else ([], 0)
            if self.mm_prefix_lm and req.mm_features:
                hits, num_hit = trim_hits(req, hits, num_hit, self.kv.block_size)
            ext = (self.connector.get_num_new_matched_tokens(req, num_hit)
                   if self.connector is not None and not req.skip_prefix_cache else 0)
            n = min(req.num_tokens - num_hit - ext, budget)
            enc, n = self._encoder_inputs(req, num_hit + ext, n)
            if n == 0 or not self.kv.allocate_slots(req, n, hits, ext):
                return self._unref_encoder_inputs(req)
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, self.kv.block_ids(req.request_id), ext)
            self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit + ext
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit + ext
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append(ScheduledRequest(req, n, encoder_inputs=self._allocate_encoder_inputs(req, enc)))
        return n

    # ---- multimodal: the encoder's share of a step (pagedllm.multimodal.encoder_cache) ------------------------
    def _encoder_inputs(self, req: Request, num_computed: int, n: int) -> tuple[list[int], int]:
        """The request's images this step must encode, and its tokens cut before an image that does not fit."""
        if self.encoder_cache is None or not req.mm_features:
            return [], n
        if self.mm_prefix_lm:
            n = whole_spans(req, num_computed, n)
        enc, n, self.encoder_budget = schedule_encoder_inputs(req, num_computed, n, self.encoder_cache,
                                                              self.encoder_budget)
        return enc, n

    def _allocate_encoder_inputs(self, req: Request, enc: list[int]) -> list[int]:
        for i in enc:
            self.encoder_cache.allocate(req, i)
        return enc

    def _unref_encoder_inputs(self, req: Request) -> int:
        """The request was not scheduled after all: drop the cache references its planning took; returns 0."""
        if self.encoder_cache is not None:
            self.encoder_cache.free(req)
        return 0

    def schedule(self, max_seqs: Optional[int] = None) -> SchedulerOutput:
        """The next step: at most ``max_seqs`` requests (the batch queue's share), skipping those in flight."""
        out = SchedulerOutput()
        max_seqs = max_seqs if max_seqs is not None else 1 << 62  # (no share: max_num_seqs bounds running alone)
        budget = self.max_num_batched_tokens
        self.encoder_budget = self.max_num_encoder_input_tokens
        if self.policy == "priority":
            self.running.sort(key=self._rank)
        rows = self._row_shares()
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < max_seqs:
            req = self.running[i]
            if req.request_id in self.in_flight or rows.full(req):
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            enc, n = self._encoder_inputs(req, req.num_computed_tokens, n)
            if n == 0 and req.mm_features:  # its next image does not fit this step's encoder budget or cache
                i += 1
                continue
            # Speculation: a decoding request reserves its lookahead slots too (spec_decode plans num_lookahead).
            la = min(req.num_lookahead, budget - 1) if n == 1 and req.num_lookahead > 0 else 0
            n += la
            while self.requires_kv_cache and not self.kv.allocate_slots(req, n):
                victim = max(self._preemptible(), key=self._rank)  # (req itself is one)
                before = self.running.index(victim) < i
                self._preempt(victim, out)
                if victim is req:
                    break
                if before:  # the victim was already scheduled this step (running is not in rank order): undo it
                    k = next(k for k, s in enumerate(out.scheduled) if s.request is victim)
                    budget += out.scheduled.pop(k).num_new_tokens
                    i -= 1
            if req.status != RequestStatus.RUNNING:
                continue  # req itself was preempted: self.running shrank, i now points past the end
            out.scheduled.append(ScheduledRequest(req, n, num_lookahead=la,
                                                  encoder_inputs=self._allocate_encoder_inputs(req, enc)))
            rows.take(req)
            budget -= n
            i += 1
        rows.rotate(self.running, out)
        if out.preempted:  # admitting new work now would only thrash
            return out
        skipped: list[Request] = []  # waiting requests whose adapter has no free slot this step (vLLM's rule)
        loras = {r.lora_int_id for r in self.running} - {0}
        while self.waiting and budget > 0 and len(out.scheduled) < max_seqs:
            req = next((r for r in self.waiting if (r.structured is None or r.structured.ready)
                        and not rows.full(r)), None)
            if req is None:
                break  # every waiting request still waits for its grammar to compile (or its share is full)
            if req.swapped_blocks is not None and out.swap_out:
                break  # its host blocks may be reused by this step's swap-out: resume it next step
            if req.lora_int_id and req.lora_int_id not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            n = self._admit(req, out, budget) if len(self.running) < self.max_num_seqs else 0
            if n == 0 and self.policy == "priority" and self._preemptible():
                # A more urgent request preempts the least urgent running one (recompute: no swap ordering issue).
                victim = max(self._preemptible(), key=self._rank)
                if self._rank(victim) <= self._rank(req):
                    break
                for k, s in enumerate(out.scheduled):
                    if s.request is victim:
                        budget += out.scheduled.pop(k).num_new_tokens
                        break
                self._preempt(victim, out, allow_swap=False)
                continue
            if n == 0:
                break
            self.waiting.remove(req)
            rows.take(req)
            budget -= n
            if req.lora_int_id:
                loras.add(req.lora_int_id)
        self.waiting.extendleft(reversed(skipped))
        return out

    def _row_shares(self) -> "RowShares":
        """This step's per-request row caps: none unless requests of more than one client request are active."""
        first = self.running[0].parent_id if self.running else (self.waiting[0].parent_id if self.waiting else None)
        shared = any(r.parent_id != first for r in chain(self.running, self.waiting))
        return RowShares(self.max_rows_per_request if shared else None)

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts once the model ran the step (before new tokens are appended)."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if self.encoder_cache is not None and s.request.mm_features:  # images whose tokens are all computed
                free_computed_inputs(s.request, self.encoder_cache)

    def rollback(self, req: Request, num_rejected: int) -> None:
        """Forget the K/V of rejected speculative tokens: they are recomputed (overwritten) if ever needed, and
        lookahead blocks that now hold nothing go back to the pool."""
        req.num_computed_tokens -= num_rejected
        self.kv.trim(req, req.num_tokens)

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
        if self.connector is None or not self.connector.request_finished(req, self.kv.block_ids(req.request_id)):
            self.kv.free(req)  # (else the connector keeps them until its transfer is done)
        if self.encoder_cache is not None:
            self.encoder_cache.free(req)
        if req.swapped_blocks is not None:
            self.swap.release([self.swap.blocks[h] for h in req.swapped_blocks])
            req.swapped_blocks = None
            if self.kv.state_swap is not None:
                self.kv.state_swap.release(req.request_id)


class RowShares:
    """Rows each client request (a parent and its ``n`` children) took this step, against a cap (None: no cap)."""

    def __init__(self, cap: Optional[int]):
        self.cap = cap
        self.taken: Counter[str] = Counter()

    def full(self, req: Request) -> bool:
        return self.cap is not None and self.taken[req.parent_id] >= self.cap

    def take(self, req: Request) -> None:
        self.taken[req.parent_id] += 1

    def rotate(self, running: list[Request], out: "SchedulerOutput") -> None:
        """Move the scheduled samples of a capped request behind its unscheduled ones, so the next step serves
        those (stable: other requests keep their order)."""
        if self.cap is None or not any(n >= self.cap for n in self.taken.values()):
            return
        capped = {p for p, n in self.taken.items() if n >= self.cap}
        done = {id(s.request) for s in out.scheduled}
        moved = [r for r in running if r.parent_id in capped and id(r) in done]
        if moved:
            keep = [r for r in running if not (r.parent_id in capped and id(r) in done)]
            running[:] = keep + moved
