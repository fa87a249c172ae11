"""The encoder cache: vision-encoder outputs kept by content hash under a token budget (vLLM v1's
``EncoderCacheManager`` on the scheduler side, a dict of tensors on the worker side).

An image is encoded once, when the first chunk that reaches its placeholder tokens is scheduled; its output stays
cached while any request still has placeholder tokens of it to prefill, so chunked prefill can split a prompt in the
middle of an image. Once no request references it, the entry is *freeable*: it stays (another request with the same
pixels reuses it without encoding) until its space is needed, and is then evicted, least recently freed first; the
scheduler hands the evicted hashes to the worker, which drops the tensors (``get_freed_mm_hashes``).

Budgets are in encoder output tokens (an image's placeholder length): ``cache_size`` bounds what is cached at once;
the scheduler's per-step ``max_num_encoder_input_tokens`` bounds what is encoded in one step.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pagedllm.multimodal.inputs import MultiModalFeatureSpec


def features_of(request: Any) -> list[MultiModalFeatureSpec]:
    return getattr(request, "mm_features", None) or []


class EncoderCacheManager:
    """Scheduler-side accounting of the encoder cache (no tensors): what is cached, who references it, what may be
    evicted."""

    def __init__(self, cache_size: int):
        if cache_size < 1:
            raise ValueError(f"encoder cache size must be >= 1 token, got {cache_size}")
        self.cache_size = cache_size
        self.num_free_slots = cache_size  # not held by a referenced entry
        self.num_freeable_slots = cache_size  # free or held by an unreferenced (evictable) entry
        self.cached: dict[str, set[str]] = {}  # mm hash -> ids of the requests that reference it
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced entries, least recently freed first
        self.freed: list[str] = []  # evicted since the last get_freed_mm_hashes()

    def check_and_update_cache(self, request: Any, input_id: int) -> bool:
        """True if item ``input_id`` of ``request`` is cached; the request then references it."""
        mm_hash = features_of(request)[input_id].identifier
        refs = self.cached.get(mm_hash)
        if refs is None:
            return False
        if not refs:  # it was freeable: referenced again (its space was never free, now it is not evictable)
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        refs.add(request.request_id)
        return True

    def can_allocate(self, request: Any, input_id: int, encoder_compute_budget: int,
                     num_tokens_to_schedule: int) -> bool:
        """Room for item ``input_id`` within this step's remaining compute budget, counting the
        ``num_tokens_to_schedule`` encoder tokens already planned this step; evicts freeable entries if needed."""
        n = features_of(request)[input_id].num_encoder_tokens
        if n > encoder_compute_budget:
            return False
        total = n + num_tokens_to_schedule
        if total <= self.num_free_slots:
            return True
        if total > self.num_freeable_slots:
            return False
        while total > self.num_free_slots:  # evict the least recently freed entries
            mm_hash, size = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += size
        return True

    def allocate(self, request: Any, input_id: int) -> None:
        """Reserve item ``input_id``'s space (after ``can_allocate``): it is encoded in this step."""
        feature = features_of(request)[input_id]
        self.cached.setdefault(feature.identifier, set()).add(request.request_id)
        self.num_free_slots -= feature.num_encoder_tokens
        self.num_freeable_slots -= feature.num_encoder_tokens

    def get_cached_input_ids(self, request: Any) -> set[int]:
        return {i for i, f in enumerate(features_of(request)) if f.identifier in self.cached}

    def free_encoder_input(self, request: Any, input_id: int) -> None:
        """The request no longer needs item ``input_id`` (its placeholder tokens are computed); unreferenced, the
        entry becomes freeable."""
        feature = features_of(request)[input_id]
        refs = self.cached.get(feature.identifier)
        if not refs or request.request_id not in refs:
            return
        refs.discard(request.request_id)
        if not refs:
            self.freeable[feature.identifier] = feature.num_encoder_tokens
            self.num_freeable_slots += feature.num_encoder_tokens

    def free(self, request: Any) -> None:
        """Drop every reference the request holds (finished, aborted or preempted)."""
        for i in range(len(features_of(request))):
            self.free_encoder_input(request, i)

    def get_freed_mm_hashes(self) -> list[str]:
        """Hashes evicted since the last call: the worker drops their tensors."""
        out, self.freed = self.freed, []
        return out

    @property
    def num_referenced_tokens(self) -> int:
        return self.cache_size - self.num_freeable_slots


def schedule_encoder_inputs(request: Any, num_computed_tokens: int, num_new_tokens: int,
                            encoder_cache: EncoderCacheManager, encoder_compute_budget: int,
                            ) -> tuple[list[int], int, int]:
    """vLLM's ``_try_schedule_encoder_inputs``: the items this step must encode for a request that computes tokens
    ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``, the (possibly cut) number of new tokens, and
    the compute budget left. An item whose placeholders the step reaches but that is neither cached nor fits cuts
    the step just before its first placeholder token (0 tokens: the request waits a step)."""
    to_encode: list[int] = []
    planned = 0
    end = num_computed_tokens + num_new_tokens
    for i, feature in enumerate(features_of(request)):
        start, length = feature.mm_position.offset, feature.mm_position.length
        if start >= end:
            break  # not reached this step
        if start + length <= num_computed_tokens:
            continue  # its tokens' K/V is computed (or came from the prefix cache)
        if any(features_of(request)[j].identifier == feature.identifier for j in to_encode):
            continue  # the same pixels twice in one prompt: encoded once
        if encoder_cache.check_and_update_cache(request, i):
            continue
        if not encoder_cache.can_allocate(request, i, encoder_compute_budget, planned):
            num_new_tokens = max(0, start - num_computed_tokens)
            break
        planned += length
        encoder_compute_budget -= length
        to_encode.append(i)
    return to_encode, num_new_tokens, encoder_compute_budget


def free_computed_inputs(request: Any, encoder_cache: EncoderCacheManager) -> None:
    """After a step: release the request's reference to every image whose placeholder tokens are all computed (an
    image appearing twice stays referenced until its last occurrence is)."""
    feats = features_of(request)
    done: dict[str, bool] = {}
    for f in feats:
        done[f.identifier] = done.get(f.identifier, True) and f.mm_position.end <= request.num_computed_tokens
    for i, f in enumerate(feats):
        if done[f.identifier]:
            encoder_cache.free_encoder_input(request, i)
