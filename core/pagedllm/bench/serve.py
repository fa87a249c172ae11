"""Online serving benchmark against any OpenAI-compatible server (``pagedllm serve``, ``vllm serve``).

Requests arrive as a Poisson process at ``--request-rate`` (inf: all at once), each a streamed /v1/completions call
with a random token-id prompt of exactly ``--input-len`` tokens and ``ignore_eos`` so it yields exactly
``--output-len`` tokens. Reports request and token throughput and TTFT / TPOT / ITL / end-to-end latency (mean,
median, p99), as vLLM's ``benchmarks/benchmark_serving.py`` defines them:
TTFT: send -> first chunk carrying output (text, or token ids: ``return_token_ids``, vLLM's extension, makes
tokenizer-less models measurable); TPOT per request: (latency - TTFT) / (output tokens - 1);
ITL: the gaps between successive output chunks (a chunk may carry several tokens when the server coalesces).

``--prefix-repetition-num-prefixes T --prefix-repetition-prefix-len L`` (vLLM's ``prefix_repetition`` dataset): a
multi-tenant shared-prefix workload instead, T random L-token prefixes ("system prompts"), each the start of an
equal share of the prompts, followed by ``--input-len`` random tokens of its own; the prompts in random order. The
server's prefix-cache hit rate over the run is read from its ``/metrics`` (``*:prefix_cache_hits`` /
``*:prefix_cache_queries``, pagedllm's or vLLM's) where it exports them, with pagedllm's data-parallel routing
decisions (``pagedllm:dp_routing_decisions``).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

from pagedllm.errors import ParamError


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


@dataclass
class ServeBenchResult:
    base_url: str
    model: str
    num_prompts: int
    request_rate: float
    input_len: int
    output_len: int
    max_concurrency: Optional[int]
    duration_s: float = 0.0
    completed: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    total_token_throughput: float = 0.0
    mean_ttft_ms: float = 0.0
    median_ttft_ms: float = 0.0
    p99_ttft_ms: float = 0.0
    mean_tpot_ms: float = 0.0
    median_tpot_ms: float = 0.0
    p99_tpot_ms: float = 0.0
    mean_itl_ms: float = 0.0
    median_itl_ms: float = 0.0
    p99_itl_ms: float = 0.0
    mean_e2el_ms: float = 0.0
    median_e2el_ms: float = 0.0
    p99_e2el_ms: float = 0.0
    num_prefixes: int = 0  # shared-prefix workload: tenants (0: plain random prompts)
    prefix_len: int = 0
    # the server's prefix cache over the run (None: its /metrics has no such counters), and its data-parallel
    # routing decisions (decision -> requests, summed over replicas; empty when not exported)
    prefix_cache_queries: Optional[int] = None
    prefix_cache_hits: Optional[int] = None
    prefix_cache_hit_rate: Optional[float] = None
    dp_routing_decisions: dict[str, int] = field(default_factory=dict)
    # per-request samples (``keep_samples``: bench sweep's latency CDF); empty otherwise
    ttft_samples_ms: list[float] = field(default_factory=list)
    e2el_samples_ms: list[float] = field(default_factory=list)


def make_prompts(num: int, input_len: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(input_len)] for _ in range(num)]


def make_prefix_prompts(num: int, num_prefixes: int, prefix_len: int, suffix_len: int, lo: int, hi: int,
                        seed: int) -> list[list[int]]:
    """``num`` prompts over ``num_prefixes`` shared ``prefix_len``-token prefixes (equal shares, the first ones one
    more), each followed by ``suffix_len`` tokens of its own; shuffled."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(lo, hi) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    out = [prefixes[i % num_prefixes] + [rng.randrange(lo, hi) for _ in range(suffix_len)] for i in range(num)]
    rng.shuffle(out)
    return out


def scrape_counters(text: str) -> dict[str, float]:
    """The prefix-cache and routing counters of a Prometheus exposition, summed over engines (no server prefix)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            name = sample.name.split(":", 1)[-1]
            if name in ("prefix_cache_hits_total", "prefix_cache_queries_total"):
                out[name] = out.get(name, 0.0) + sample.value
            elif name == "dp_routing_decisions_total":
                key = f"decision:{sample.labels.get('decision')}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


async def _counters(session, base: str, headers: dict) -> Optional[dict[str, float]]:
    """The server's counters now, or None when it serves no readable /metrics."""
    try:
        async with session.get(f"{base}/metrics", headers=headers) as r:
            if r.status != 200:
                return None
            return scrape_counters(await r.text())
    except Exception:  # noqa: BLE001 - an optional reading: the benchmark goes on without it
        return None


def arrival_gaps(num: int, rate: float, seed: int) -> list[float]:
    """Poisson process: exponential inter-arrival gaps with mean 1/rate (all zero for an infinite rate)."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(num)]


async def _one(session, url: str, headers: dict, model: str, prompt: list[int], output_len: int) -> RequestResult:
    res = RequestResult(prompt_len=len(prompt))
    payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    start = time.perf_counter()
    last = start
    try:
        async with session.post(url, json=payload, headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:200]}"
                return res
            async for line in r.content:  # aiohttp's StreamReader yields whole lines
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message"))
                    return res
                if obj.get("usage"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
                choices = obj.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("token_ids")):
                    t = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = t - start
                    else:
                        res.itl.append(t - last)
                    last = t
        res.latency = time.perf_counter() - start
        res.ok = res.ttft > 0.0
        if not res.ok:
            res.error = "no text received"
    except Exception as e:  # network errors count as failures, the run goes on
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return 0.0, 0.0, 0.0
    a = np.asarray(values) * 1000.0
    return float(a.mean()), float(np.median(a)), float(np.percentile(a, 99))


async def run_async(base_url: str, num_prompts: int, request_rate: float, input_len: int, output_len: int,
                    model: Optional[str] = None, api_key: Optional[str] = None, max_concurrency: Optional[int] = None,
                    seed: int = 0, token_id_range: tuple[int, int] = (100, 1000),
                    warmup: bool = True, keep_samples: bool = False, num_prefixes: int = 0,
                    prefix_len: int = 0) -> ServeBenchResult:
    import aiohttp  # optional: aiohttp (pagedllm[serve])

    if num_prefixes < 0 or prefix_len < 0 or (num_prefixes > 0) != (prefix_len > 0):
        raise ParamError("prefix_repetition_num_prefixes", "the shared-prefix workload needs both "
                         "--prefix-repetition-num-prefixes and --prefix-repetition-prefix-len > 0")

    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=0)  # no connection cap: --max-concurrency is the only limit
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                     read_bufsize=1 << 20) as client:
        if model is None:
            try:
                async with client.get(f"{base}/v1/models", headers=headers) as r:
                    r.raise_for_status()
                    model = (await r.json())["data"][0]["id"]
            except aiohttp.ClientConnectorError:
                raise ParamError("base_url", f"cannot connect to {base_url}; is the server running?") from None
        url = f"{base}/v1/completions"
        if num_prefixes:
            prompts = make_prefix_prompts(num_prompts, num_prefixes, prefix_len, input_len, *token_id_range, seed)
            warm = make_prompts(1, prefix_len + input_len, *token_id_range, seed + 2)[0]  # no tenant's prefix
        else:
            *prompts, warm = make_prompts(num_prompts + 1, input_len, *token_id_range, seed)  # warm-up: its own
        if warmup:
            w = await _one(client, url, headers, model, warm, min(output_len, 4))
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        before = await _counters(client, base, headers)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def limited(p: list[int]) -> RequestResult:
            if sem is None:
                return await _one(client, url, headers, model, p, output_len)
            async with sem:
                return await _one(client, url, headers, model, p, output_len)

        tasks = []
        t0 = time.perf_counter()
        for p, gap in zip(prompts, arrival_gaps(num_prompts, request_rate, seed)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(p)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        after = await _counters(client, base, headers) if before is not None else None
    out = ServeBenchResult(base, model, num_prompts, request_rate, input_len, output_len, max_concurrency,
                           duration_s=duration, num_prefixes=num_prefixes, prefix_len=prefix_len)
    if after is not None and "prefix_cache_queries_total" in after:
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        out.prefix_cache_queries = int(delta["prefix_cache_queries_total"])
        out.prefix_cache_hits = int(delta.get("prefix_cache_hits_total", 0))
        q = out.prefix_cache_queries
        out.prefix_cache_hit_rate = out.prefix_cache_hits / q if q else 0.0
        out.dp_routing_decisions = {k.split(":", 1)[1]: int(v) for k, v in delta.items() if k.startswith("decision:")}
    ok = [r for r in results if r.ok]
    out.completed, out.failed = len(ok), len(results) - len(ok)
    out.errors = sorted({r.error for r in results if not r.ok})[:5]
    out.total_input_tokens = sum(r.prompt_len for r in ok)
    out.total_output_tokens = sum(r.output_tokens for r in ok)
    out.request_throughput = out.completed / duration
    out.output_throughput = out.total_output_tokens / duration
    out.total_token_throughput = (out.total_input_tokens + out.total_output_tokens) / duration
    out.mean_ttft_ms, out.median_ttft_ms, out.p99_ttft_ms = _stats([r.ttft for r in ok])
    out.mean_tpot_ms, out.median_tpot_ms, out.p99_tpot_ms = _stats(
        [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])
    out.mean_itl_ms, out.median_itl_ms, out.p99_itl_ms = _stats([x for r in ok for x in r.itl])
    out.mean_e2el_ms, out.median_e2el_ms, out.p99_e2el_ms = _stats([r.latency for r in ok])
    if keep_samples:
        out.ttft_samples_ms = [r.ttft * 1000.0 for r in ok]
        out.e2el_samples_ms = [r.latency * 1000.0 for r in ok]
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="online serving benchmark against an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default: inf)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--token-id-range", type=int, nargs=2, default=(100, 1000), metavar=("LO", "HI"),
                   help="random prompt token ids are drawn from [LO, HI)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=0, metavar="T",
                   help="shared-prefix workload: T tenants' prefixes, each starting an equal share of the prompts "
                        "(then --input-len tokens of each prompt's own); default 0: plain random prompts")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=0, metavar="L",
                   help="tokens of each shared prefix (with --prefix-repetition-num-prefixes)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.set_defaults(func=main)


def _event_loop_runner():
    """uvloop when installed (it comes with the serve extra): the client shares the machine with the server, so
    its per-chunk cost is taken from the server's throughput."""
    try:
        import uvloop  # optional: uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def main(args) -> int:
    res = _event_loop_runner()(run_async(
        args.base_url, args.num_prompts, args.request_rate, args.input_len, args.output_len, args.model, args.api_key,
        args.max_concurrency, args.seed, tuple(args.token_id_range), not args.no_warmup,
        num_prefixes=args.prefix_repetition_num_prefixes, prefix_len=args.prefix_repetition_prefix_len))
    print(f"model={res.model} base_url={res.base_url}")
    shared = (f" ({res.num_prefixes} shared {res.prefix_len}-token prefixes + {res.input_len} own)"
              if res.num_prefixes else "")
    print(f"workload: {res.num_prompts} prompts x {res.prefix_len + res.input_len}{shared} -> {res.output_len} tokens, "
          f"rate {res.request_rate} req/s, max concurrency {res.max_concurrency}")
    print(f"completed {res.completed}, failed {res.failed} in {res.duration_s:.2f} s"
          + (f"; errors: {res.errors}" if res.errors else ""))
    print(f"throughput: {res.request_throughput:.2f} req/s, {res.output_throughput:.1f} output tok/s, "
          f"{res.total_token_throughput:.1f} total tok/s")
    for name in ("ttft", "tpot", "itl", "e2el"):
        print(f"{name.upper():>5} ms: mean {getattr(res, f'mean_{name}_ms'):.2f}  "
              f"median {getattr(res, f'median_{name}_ms'):.2f}  p99 {getattr(res, f'p99_{name}_ms'):.2f}")
    if res.prefix_cache_hit_rate is not None:
        print(f"prefix cache: {res.prefix_cache_hits} of {res.prefix_cache_queries} prompt tokens hit "
              f"({100 * res.prefix_cache_hit_rate:.1f}%)"
              + (f"; data-parallel routing {res.dp_routing_decisions}" if res.dp_routing_decisions else ""))
    if args.json:
        data = asdict(res)
        if math.isinf(data["request_rate"]):
            data["request_rate"] = "inf"  # strict JSON has no Infinity
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    return 0 if res.failed == 0 else 1
