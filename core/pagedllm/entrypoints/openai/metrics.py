"""Prometheus metrics with vLLM's meanings under a ``pagedllm:`` prefix, one registry per app.

Gauges and counters that the engine already keeps (running/waiting, KV usage, prefix-cache queries/hits, token
counts, preemptions) are read at scrape time from the engine process's latest stats snapshot by a custom collector, so
nothing on the hot path touches prometheus; each carries vLLM's ``engine`` label, one sample per data-parallel
replica. Latency histograms are observed by the HTTP handlers when a request ends.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.engine.llm_engine import EngineStats
from pagedllm.engine.prefix_router import RoutingStats
from pagedllm.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """One sample per engine (data-parallel replica) with vLLM's ``engine`` label ("0" when there is one)."""

    def __init__(self, replicas: Callable[[], Sequence[tuple[EngineStats, int]]], model_name: str):
        self.replicas = replicas
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        reps = list(self.replicas())
        labels = ["model_name", "engine"]

        def family(kind: str, name: str, doc: str, values: Sequence[float]) -> Metric:
            f = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(f"pagedllm:{name}", doc, labels=labels)
            for i, v in enumerate(values):
                f.add_metric([self.model_name, str(i)], v)
            return f

        stats = [s for s, _ in reps]
        for kind, name, doc, attr in _ENGINE_METRICS:
            yield family(kind, name, doc, [getattr(s, attr) for s in stats])
        yield family("counter", "engine_requests", "Requests this engine accepted (the data-parallel balancer's "
                                                   "choice when there are several).", [n for _, n in reps])
        if stats[0].max_loras:
            info = GaugeMetricFamily("pagedllm:lora_requests_info", "Running stats on LoRA requests (vLLM's).",
                                     labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora", "engine"])
            for i, s in enumerate(stats):
                info.add_metric([",".join(s.running_loras), ",".join(s.waiting_loras), str(s.max_loras), str(i)], 1.0)
            yield info
            for name, doc in _LORA_COUNTERS:
                yield family("counter", name, doc, [getattr(s, name) for s in stats])
        if stats[0].spec_decode_enabled:
            for kind, name, doc in _SPEC_METRICS:
                yield family(kind, name, doc, [getattr(s, name) for s in stats])
        if stats[0].kv_offload:  # a KV connector runs (docs/kv-offload.md)
            yield from _kv_offload_metrics(self.model_name, stats)


class _RoutingCollector(Collector):
    """Data parallel: where the front end placed requests and why (``engine/prefix_router.py``), per replica."""

    def __init__(self, routing: Callable[[], RoutingStats], model_name: str):
        self.routing = routing
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        stats = self.routing()
        decisions = CounterMetricFamily(
            "pagedllm:dp_routing_decisions", "Requests the data-parallel router placed on each engine, by decision: "
            "prefix_match (its recorded prefix cache held the longest prefix), load_bound (a prefix match elsewhere "
            "lost to the load bound), least_loaded (no match, or --dp-routing least_loaded).",
            labels=["model_name", "engine", "decision"])
        for decision, per_engine in stats.decisions.items():
            for i, v in enumerate(per_engine):
                decisions.add_metric([self.model_name, str(i), decision], v)
        yield decisions
        predicted = CounterMetricFamily(
            "pagedllm:dp_routing_predicted_hit_tokens", "Prompt tokens the data-parallel router expected each "
            "engine's prefix cache to serve when it placed requests there (compare prefix_cache_hits).",
            labels=["model_name", "engine"])
        for i, v in enumerate(stats.predicted_hit_tokens):
            predicted.add_metric([self.model_name, str(i)], v)
        yield predicted


#: (kind, name after ``pagedllm:``, help, EngineStats field): vLLM's names where vLLM has the metric.
_ENGINE_METRICS = (
    ("gauge", "num_requests_running", "Number of requests in model execution batches.", "num_running"),
    ("gauge", "num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    ("gauge", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
    ("gauge", "kv_cache_used_blocks", "KV-cache blocks held by requests.", "num_used_blocks"),
    ("gauge", "kv_cache_total_blocks", "KV-cache blocks in the pool.", "num_blocks"),
    ("gauge", "kv_cache_cached_blocks", "Free KV-cache blocks still holding reusable prefix-cache content.",
     "num_cached_blocks"),
    ("counter", "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_queries"),
    ("counter", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_hits"),
    ("counter", "num_preemptions", "Cumulative number of preemptions from the engine.", "num_preemptions"),
    ("counter", "prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("counter", "generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    ("counter", "mm_items_processed", "Images run through the engine process's own HF processor.",
     "mm_items_processed"),
    ("counter", "mm_items_preprocessed", "Images the engine received already processed (render workers).",
     "mm_items_preprocessed"),
)
#: LoRA counters (only when LoRA is enabled); the name is also the EngineStats field.
_LORA_COUNTERS = (
    ("lora_disk_loads", "LoRA adapter folders read from disk."),
    ("lora_slot_loads", "LoRA adapters copied into a device slot."),
    ("lora_slot_evictions", "LoRA adapters swapped out of a device slot for another."),
    ("lora_cpu_evictions", "LoRA host copies dropped by the max_cpu_loras LRU."),
)
#: Speculative decoding (only with a speculative_config); the name is also the EngineStats field.
_SPEC_METRICS = (
    ("counter", "spec_decode_num_drafts", "Number of speculative verifications (requests x steps)."),
    ("counter", "spec_decode_num_draft_tokens", "Number of draft tokens proposed."),
    ("counter", "spec_decode_num_accepted_tokens", "Number of draft tokens accepted."),
    ("gauge", "spec_decode_acceptance_rate", "Accepted / proposed draft tokens, since start."),
    ("gauge", "spec_decode_mean_accepted_length", "Tokens emitted per verification (1 + accepted / drafts)."),
)


#: KV offload tiers (only with a KV connector): (kind, name after ``pagedllm:kv_offload_``, help); a ``tier`` label.
_KV_OFFLOAD_TIER_METRICS = (
    ("counter", "hits", "Prefix-cache blocks loaded back from this tier."),
    ("counter", "misses", "Prefix lookups that found no further block in this tier."),
    ("counter", "bytes_loaded", "Bytes copied from this tier into the device KV cache."),
    ("counter", "bytes_saved", "Bytes of evicted prefix-cache blocks written to this tier."),
)
_KV_OFFLOAD_METRICS = (
    ("gauge", "host_blocks", "Blocks the host tier holds."),
    ("counter", "load_errors", "Blocks a KV connector failed to load (their requests were recomputed)."),
    ("counter", "recomputes", "Requests recomputed from a failed KV load."),
    ("gauge", "delayed_frees", "Finished requests whose blocks a KV connector still holds."),
)


def _kv_offload_metrics(model_name: str, stats: Sequence[EngineStats]) -> Iterable[Metric]:
    for kind, name, doc in _KV_OFFLOAD_TIER_METRICS:
        f = CounterMetricFamily(f"pagedllm:kv_offload_{name}", doc, labels=["model_name", "engine", "tier"])
        for i, s in enumerate(stats):
            for tier in ("host", "disk"):
                f.add_metric([model_name, str(i), tier], s.kv_offload.get(f"{tier}_{name}", 0))
        yield f
    for kind, name, doc in _KV_OFFLOAD_METRICS:
        f = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(f"pagedllm:kv_offload_{name}", doc,
                                                                           labels=["model_name", "engine"])
        for i, s in enumerate(stats):
            f.add_metric([model_name, str(i)], s.kv_offload.get(name, 0))
        yield f


class ServerMetrics:
    """The app's registry: engine snapshot collector plus request-latency histograms."""

    def __init__(self, replicas: Callable[[], Sequence[tuple[EngineStats, int]]], model_name: str,
                 routing: Optional[Callable[[], RoutingStats]] = None):
        """``replicas``: (stats snapshot, requests accepted) of each engine, e.g. ``AsyncEngine.replica_stats``;
        ``routing``: the data-parallel router's decisions (``DataParallelEngine.routing_stats``), if any."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.registry.register(_EngineCollector(replicas, model_name))
        if routing is not None:
            self.registry.register(_RoutingCollector(routing, model_name))
        lab = ["model_name"]
        self.ttft = Histogram("pagedllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              lab, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.tpot = Histogram("pagedllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (request mean after the first).",
                              lab, buckets=_TPOT_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("pagedllm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", lab, buckets=_E2E_BUCKETS,
                             registry=self.registry).labels(model_name)
        self.success = Counter("pagedllm:request_success", "Count of successfully processed requests.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.aborted = Counter("pagedllm:request_aborted", "Requests aborted (client disconnect or shutdown).",
                               lab, registry=self.registry).labels(model_name)
        self.rejected = Counter("pagedllm:request_rejected",
                                "Requests refused at admission with 429 (--max-num-queued-reqs).",
                                lab, registry=self.registry).labels(model_name)

    def observe_finished(self, out: RequestOutput) -> None:
        """Record one finished request's latencies from the engine's timestamps (wall clock, time.time())."""
        m = out.metrics or {}
        arrival, first, last = m.get("arrival_time"), m.get("first_token_time"), m.get("last_token_time")
        now = time.time()
        if arrival is not None:
            self.e2e.observe(max(now - arrival, 0.0))
            if first is not None:
                self.ttft.observe(max(first - arrival, 0.0))
        n = max((len(c.token_ids) for c in out.outputs), default=0)
        if first is not None and last is not None and n > 1:
            self.tpot.observe(max(last - first, 0.0) / (n - 1))
        for c in out.outputs:
            self.success.labels(self.model_name, c.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
