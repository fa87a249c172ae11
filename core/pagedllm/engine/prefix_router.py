"""Cache-aware routing over data-parallel replicas (SGLang router's ``cache_aware`` policy, on block hashes).

The server keeps, per replica, an approximate record of the prompt prefixes it sent there: the chained hashes of each
prompt's full blocks, computed as that replica's prefix cache computes them (``sched.block_hash.hash_block``, the
replica's block size, a LoRA adapter's id keyed into the first block), in an LRU bounded by the replica's KV pool so
that entries age out roughly as the replica evicts them. A request goes to the replica whose record holds the longest
leading run of its hashes (ties: the less loaded, then round robin), unless that replica's load exceeds the
least-loaded replica's by more than ``balance_abs_threshold`` requests *and* ``balance_rel_threshold`` times (SGLang's
two thresholds); then, and when no replica matches, it goes to the least-loaded replica. A request placed by load
records its prefix there too, so a hot prefix spreads over the replicas instead of queueing on one.

The record is a guess: it does not see a replica evict early (its pool also holds running requests and generated
tokens) nor a cache reset. A wrong guess costs a cache miss, never a wrong output: routing only chooses where a
request runs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pagedllm.errors import ParamError
from pagedllm.sched.block_hash import hash_block

#: ``--dp-routing`` values: the longest cached prefix within the load bound (default), or load alone.
ROUTING_POLICIES = ("cache_aware", "least_loaded")
#: ``RoutingStats`` decision names (the ``decision`` label of ``pagedllm:dp_routing_decisions_total``).
DECISIONS = ("prefix_match", "load_bound", "least_loaded")


def least_loaded(loads: Sequence[int], start: int) -> int:
    """Index of the smallest load; among equal ones the first at or after ``start`` (round robin)."""
    n = len(loads)
    return min(((start + k) % n for k in range(n)), key=lambda i: loads[i])  # min keeps the first of ties


@dataclass(frozen=True)
class DPRoutingConfig:
    """How ``--data-parallel-size N`` places requests. The bounds are SGLang router's ``balance_abs_threshold``
    (its default, 32) and ``balance_rel_threshold`` (its default 1.0001 leaves the absolute bound alone in charge;
    1.5, its successor SMG's, also keeps a long queue on its prefix while the other is not much shorter)."""

    policy: str = "cache_aware"
    #: a prefix match loses to load when the matched replica holds more than this many requests above the minimum
    balance_abs_threshold: int = 32
    #: ... and more than this many times the minimum
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ParamError("dp_routing", f"must be one of {', '.join(ROUTING_POLICIES)}, got {self.policy!r}")
        if isinstance(self.balance_abs_threshold, bool) or not isinstance(self.balance_abs_threshold, int) \
                or self.balance_abs_threshold < 0:
            raise ParamError("dp_balance_abs_threshold", f"must be an integer >= 0, got {self.balance_abs_threshold!r}")
        if isinstance(self.balance_rel_threshold, bool) or not isinstance(self.balance_rel_threshold, (int, float)) \
                or not self.balance_rel_threshold >= 1.0:
            raise ParamError("dp_balance_rel_threshold", f"must be a number >= 1, got {self.balance_rel_threshold!r}")


@dataclass
class RoutingStats:
    """Per replica, since start: requests placed by each decision, and the prompt tokens the router expected the
    replica's prefix cache to serve (compare with its ``prefix_hits``)."""

    decisions: dict[str, list[int]] = field(default_factory=dict)
    predicted_hit_tokens: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, n: int) -> "RoutingStats":
        return cls({d: [0] * n for d in DECISIONS}, [0] * n)

    def copy(self) -> "RoutingStats":
        return RoutingStats({d: list(v) for d, v in self.decisions.items()}, list(self.predicted_hit_tokens))


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, lora_int_id: int = 0) -> list[bytes]:
    """Chained hashes of the prompt's full blocks, as ``KVCacheManager`` keys them (the adapter id in the first)."""
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        extra = (lora_int_id or None) if i == 0 else None
        out.append(hash_block(out[-1] if out else None, token_ids[i * block_size:(i + 1) * block_size], extra))
    return out


class PrefixIndex:
    """One replica's approximate prefix-cache record: block hashes in LRU order, at most ``capacity`` of them."""

    def __init__(self, capacity: int):
        self.capacity = max(0, capacity)
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` the record holds (a chained hash stands for its whole prefix)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Record a prompt's blocks as most recently used. Last block first, so the first is the newest: a replica
        frees a sequence's blocks tail first and evicts in that order."""
        for h in reversed(hashes):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)


class PrefixRouter:
    """Chooses a replica per request (see the module docstring); one per :class:`DataParallelEngine`, and one per
    pool of ``pagedllm router`` (its replicas, or its prefill instances).

    ``block_size`` / ``capacities``: each replica's KV block size and pool size in blocks (a capacity of 0, or a
    replica without prefix caching, records nothing)."""

    def __init__(self, config: DPRoutingConfig, block_size: int, capacities: Sequence[int]):
        if not capacities:
            raise ParamError("data_parallel_size", "routing needs at least one replica")
        self.config = config
        self.block_size = block_size
        self.indexes = [PrefixIndex(c) for c in capacities]
        self.stats = RoutingStats.empty(len(capacities))
        self._rr = 0  # round-robin pointer for ties

    @property
    def cache_aware(self) -> bool:
        return self.config.policy == "cache_aware" and self.block_size > 0 and any(i.capacity for i in self.indexes)

    def route(self, token_ids: Optional[Sequence[int]], loads: Sequence[int], lora_int_id: int = 0,
              available: Optional[Sequence[bool]] = None) -> int:
        """The replica for a prompt of ``token_ids`` (None: not known, placed by load) given each replica's
        ``loads``; records the prompt's blocks there. ``available`` (default: all): the replicas that may take it
        (``pagedllm router`` leaves out a backend that is down; its record stays for when it is back)."""
        n = len(self.indexes)
        if len(loads) != n:
            raise ValueError(f"loads: {len(loads)} values for {n} replicas")
        up = [True] * n if available is None else list(available)
        if len(up) != n or not any(up):
            raise ValueError(f"available: {up} for {n} replicas (at least one must be)")
        loads = [load if ok else float("inf") for load, ok in zip(loads, up)]
        hashes = self._hashes(token_ids, lora_int_id) if self.cache_aware else []
        # The replica serves at most the blocks before the prompt's last token (one token is always computed).
        lookup = hashes[:(len(token_ids) - 1) // self.block_size] if hashes else []
        matches = [idx.match(lookup) if ok else 0 for idx, ok in zip(self.indexes, up)]
        best = max(matches)
        decision = "least_loaded"
        if best > 0:
            tied = [loads[i] if matches[i] == best else float("inf") for i in range(n)]
            pick = least_loaded(tied, self._rr)
            lo = min(loads)
            c = self.config
            if loads[pick] - lo > c.balance_abs_threshold and loads[pick] > lo * c.balance_rel_threshold:
                decision = "load_bound"
            else:
                decision = "prefix_match"
        if decision != "prefix_match":
            pick = least_loaded(loads, self._rr)
        self._rr = (pick + 1) % n
        self.stats.decisions[decision][pick] += 1
        self.stats.predicted_hit_tokens[pick] += matches[pick] * self.block_size
        if hashes:
            self.indexes[pick].insert(hashes)
        return pick

    def _hashes(self, token_ids: Optional[Sequence[int]], lora_int_id: int) -> list[bytes]:
        """The prompt's block hashes; none when its ids are unknown or malformed (the replica refuses those,
        naming the field)."""
        if not token_ids:
            return []
        try:
            return prompt_block_hashes(token_ids, self.block_size, lora_int_id)
        except (TypeError, ValueError, OverflowError):
            return []
