"""``pagedllm router``: one OpenAI endpoint in front of several ``pagedllm serve`` processes (docs/kv-offload.md,
"The router").

Two shapes. **Replicas** (``--backend URL`` repeated): each ``/v1/completions`` or ``/v1/chat/completions`` request
goes whole to one replica. **Prefill/decode disaggregation** (``--prefill URL --decode URL``, either repeated; vLLM's
``disagg_proxy_server`` shape): the prompt runs on a prefill instance (``max_tokens=1``, not streamed,
``kv_transfer_params: {"do_remote_decode": true}``), then the original request, with the ``kv_transfer_params`` the
prefill answer carried, on a decode instance, whose answer (streamed through when asked) is the client's.

Where a prefix cache pays (the replicas, the prefill instances) the instance is chosen cache-aware
(``engine/prefix_router.py``'s ``PrefixRouter``, the data-parallel server's policy: the longest recorded prefix of the
prompt's block hashes within the load bound), else, and for the decode instances, the least loaded. Load is the
requests the router has in flight on each instance. The prompt's token ids come from the tokenizer loaded here
(``--tokenizer`` / ``--model``, the chat template for chat requests), else from a backend's ``/tokenize``.

A backend that is down or restarting is routed around: a refused connection marks it down and the request goes to
another instance (a refused connection ran nothing), and a health check every ``health_interval_s`` brings it back
when its ``/health`` answers. With every instance of a role down the request is retried ``connect_retries`` times,
0.5 s apart, then answered 503 in the OpenAI error shape, never a hang: every call has a timeout."""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from pagedllm.engine.prefix_router import DPRoutingConfig, PrefixRouter, least_loaded
from pagedllm.entrypoints.openai.errors import error_body

logger = logging.getLogger(__name__)

FORWARDED_HEADERS = ("authorization", "x-request-id")
#: Backend counters the router's ``/metrics`` relays per backend (the bench's prefix-cache hit rate reads them).
RELAYED_COUNTERS = ("pagedllm:prefix_cache_queries", "pagedllm:prefix_cache_hits")


class BackendDown(Exception):
    def __init__(self, which: str, why: str):
        super().__init__(f"the {which} instance is unavailable: {why}")
        self.which = which


def unavailable(message: str) -> JSONResponse:
    return JSONResponse(error_body(503, message, code="backend_unavailable"), status_code=503,
                        headers={"Retry-After": "1"})


def prefill_body(body: dict) -> dict:
    """The request as the prefill instance runs it: one token, not streamed, its KV handed on."""
    out = {k: v for k, v in body.items()
           if k not in ("stream", "stream_options", "max_completion_tokens", "min_tokens", "n", "best_of")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    return out


@dataclass
class Instance:
    """One ``pagedllm serve`` behind the router, as the router sees it."""

    url: str
    role: str
    index: int
    in_flight: int = 0
    up: bool = True
    why_down: str = ""


class Pool:
    """The instances of one role and the :class:`PrefixRouter` that places requests on them."""

    def __init__(self, role: str, urls: Sequence[str], routing: DPRoutingConfig, block_size: int,
                 capacity_blocks: int):
        self.role = role
        self.backends = [Instance(u.rstrip("/"), role, i) for i, u in enumerate(urls)]
        self.router = PrefixRouter(routing, block_size, [capacity_blocks] * len(urls))

    @property
    def cache_aware(self) -> bool:
        return self.router.cache_aware

    def pick(self, token_ids: Optional[list[int]], tried: set[int], place: bool = True) -> Optional[Instance]:
        """The instance for this prompt among those up and not yet tried; when none is known up, any not tried (it
        may be back: the connection will tell); None when every instance was tried. ``place=False`` (a plain GET):
        the least loaded, not counted as a routing decision."""
        free = [b.index not in tried for b in self.backends]
        avail = [ok and b.up for ok, b in zip(free, self.backends)]
        if not any(avail):
            avail = free
        if not any(avail):
            return None
        loads = [b.in_flight for b in self.backends]
        if not place:
            return self.backends[least_loaded([x if ok else float("inf") for x, ok in zip(loads, avail)], 0)]
        return self.backends[self.router.route(token_ids, loads, 0, avail)]

    def mark(self, b: Instance, up: bool, why: str = "") -> None:
        if b.up != up:
            logger.warning("router: %s instance %s is %s", self.role, b.url, "back" if up else f"down ({why})")
        b.up, b.why_down = up, ("" if up else why)


class Router:
    """The proxy's state: its pools, the HTTP client, the tokenizer for routing.

    ``backends``: plain replicas; or ``prefill`` and ``decode`` instances (a single URL string each still works)."""

    def __init__(self, prefill: Sequence[str] | str = (), decode: Sequence[str] | str = (), timeout_s: float = 300.0,
                 connect_retries: int = 5, retry_delay_s: float = 0.5, *, backends: Sequence[str] = (),
                 routing: Optional[DPRoutingConfig] = None, block_size: int = 16, capacity_blocks: int = 65536,
                 tokenizer: Any = None, health_interval_s: float = 1.0):
        prefill = [prefill] if isinstance(prefill, str) else list(prefill)
        decode = [decode] if isinstance(decode, str) else list(decode)
        backends = list(backends)
        if backends and (prefill or decode):
            raise ValueError("backend: give either --backend (replicas) or --prefill and --decode (P/D), not both")
        if not backends and not (prefill and decode):
            raise ValueError("backend: give --backend URL (replicas), or both --prefill URL and --decode URL")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        routing = routing or DPRoutingConfig()
        by_load = DPRoutingConfig("least_loaded")
        if backends:
            self.pools = {"backend": Pool("backend", backends, routing, block_size, capacity_blocks)}
        else:  # the prefill instance is where a prefix cache pays; a decode instance is chosen by load
            self.pools = {"prefill": Pool("prefill", prefill, routing, block_size, capacity_blocks),
                          "decode": Pool("decode", decode, by_load, block_size, 0)}
        self.disaggregated = not backends
        self.tokenizer = tokenizer
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)
        self.connect_retries = connect_retries
        self.retry_delay_s = retry_delay_s
        self.health_interval_s = health_interval_s
        self.client: Optional[httpx.AsyncClient] = None
        # one thread: a fast tokenizer used from two threads at once fails ("Already borrowed")
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="router-tokenize")
        self._health_task: Optional[asyncio.Task] = None

    @property
    def all_backends(self) -> list[Instance]:
        return [b for p in self.pools.values() for b in p.backends]

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=1000))
        if self.health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self.client is not None:
            await self.client.aclose()
        self._tokenize_pool.shutdown(wait=False)

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval_s)

    async def check_health(self) -> None:
        """Every backend's ``/health`` at once (a short timeout); marks each up or down."""
        async def one(pool: Pool, b: Instance) -> None:
            try:
                r = await self.client.get(b.url + "/health", timeout=2.0)
                pool.mark(b, r.status_code == 200, f"/health answered HTTP {r.status_code}")
            except httpx.HTTPError as e:
                pool.mark(b, False, type(e).__name__)
        await asyncio.gather(*(one(p, b) for p in self.pools.values() for b in p.backends))

    # ---- one backend call ------------------------------------------------------------------------------------
    async def send(self, role: str, method: str, path: str, headers: dict, body: Any = None, stream: bool = False,
                   token_ids: Optional[list[int]] = None, place: bool = True) -> tuple[Instance, httpx.Response]:
        """One call to an instance of ``role``, chosen by its pool. A refused connection (down or restarting) marks
        the instance down and tries another; with none left, all are tried again ``retry_delay_s`` later, at most
        ``connect_retries`` times in all. The instance's in-flight count is raised: :meth:`done` lowers it."""
        pool = self.pools[role]
        tried: set[int] = set()
        last = ""
        for _ in range(self.connect_retries + 1):
            b = pool.pick(token_ids, tried, place)
            if b is None:  # every instance refused this request: wait for one to come back
                await asyncio.sleep(self.retry_delay_s)
                tried.clear()
                b = pool.pick(token_ids, tried, place)
            req = self.client.build_request(method, b.url + path, headers=headers, json=body)
            b.in_flight += 1
            try:
                resp = await self.client.send(req, stream=stream)
            except httpx.ConnectError as e:
                b.in_flight -= 1
                pool.mark(b, False, f"connection refused ({e})")
                tried.add(b.index)
                last = f"connection refused at {b.url} ({e})"
                continue
            except httpx.TimeoutException as e:
                b.in_flight -= 1
                raise BackendDown(role, f"no answer from {b.url} within the timeout ({type(e).__name__})") from None
            except httpx.HTTPError as e:
                b.in_flight -= 1
                raise BackendDown(role, f"{b.url}: {type(e).__name__}: {e}") from None
            if not stream:
                b.in_flight -= 1
            return b, resp
        raise BackendDown(role, last)

    @staticmethod
    def done(b: Instance) -> None:
        b.in_flight -= 1

    # ---- token ids for routing -------------------------------------------------------------------------------
    async def prompt_ids(self, path: str, body: dict, headers: dict, role: str) -> Optional[list[int]]:
        """The prompt's token ids as a backend would see them, for hashing its blocks; None when unknown (the
        request is then placed by load; a wrong guess costs a cache miss, never a wrong answer)."""
        if not self.pools[role].cache_aware:
            return None
        try:
            if path == "/v1/completions":
                prompt = body.get("prompt")
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]  # a batch goes to one instance: the first prompt places it
                if isinstance(prompt, list):
                    return prompt if all(type(t) is int for t in prompt) else None
                if not isinstance(prompt, str):
                    return None
                if self.tokenizer is not None:
                    special = body.get("add_special_tokens", True) is not False
                    return await self._in_tokenizer_thread(
                        lambda: self.tokenizer(prompt, add_special_tokens=special)["input_ids"])
                return await self._remote_tokenize(role, headers, {"model": body.get("model"), "prompt": prompt})
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            if self.tokenizer is not None:
                return await self._in_tokenizer_thread(lambda: self._chat_ids(messages, body))
            return await self._remote_tokenize(role, headers, {"model": body.get("model"), "messages": messages})
        except Exception as e:  # noqa: BLE001 - a prompt the router cannot tokenize is placed by load
            logger.debug("router: no token ids for routing (%s)", e)
            return None

    async def _in_tokenizer_thread(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn)

    def _chat_ids(self, messages: list, body: dict) -> Optional[list[int]]:
        flat = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):  # text parts only: an image's tokens are the backend's business
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            flat.append(dict(m, content=content if content is not None else ""))
        ids = self.tokenizer.apply_chat_template(flat, tokenize=True, add_generation_prompt=True,
                                                 **(body.get("chat_template_kwargs") or {}))
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers >= 5 answers a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    async def _remote_tokenize(self, role: str, headers: dict, payload: dict) -> Optional[list[int]]:
        """No local tokenizer: ask an instance that is up (its ``/tokenize``, vLLM's route)."""
        b = next((b for b in self.pools[role].backends if b.up), None)
        if b is None:
            return None
        r = await self.client.post(b.url + "/tokenize", headers=headers, json=payload, timeout=10.0)
        return r.json()["tokens"] if r.status_code == 200 else None

    # ---- routes ----------------------------------------------------------------------------------------------
    async def generate(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return JSONResponse(error_body(400, "the body must be a JSON object"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body(400, "the body must be a JSON object"), status_code=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        final = "decode" if self.disaggregated else "backend"
        try:
            if self.disaggregated:
                ids = await self.prompt_ids(path, body, headers, "prefill")
                _, pre = await self.send("prefill", "POST", path, headers, prefill_body(body), token_ids=ids)
                if pre.status_code != 200:  # the client's request is bad (4xx: P's answer says why) or P failed
                    if pre.status_code < 500:
                        return Response(pre.content, status_code=pre.status_code, media_type="application/json")
                    raise BackendDown("prefill", f"HTTP {pre.status_code}: {pre.text[:300]}")
                try:
                    params = pre.json().get("kv_transfer_params")
                except (ValueError, AttributeError):
                    raise BackendDown("prefill", f"not a JSON object: {pre.text[:200]!r}") from None
                body = dict(body, kv_transfer_params=params) if params else body
                ids = None
            else:
                ids = await self.prompt_ids(path, body, headers, "backend")
            if not body.get("stream"):
                _, out = await self.send(final, "POST", path, headers, body, token_ids=ids)
                if out.status_code >= 500:
                    raise BackendDown(final, f"HTTP {out.status_code}: {out.text[:300]}")
                return Response(out.content, status_code=out.status_code, media_type="application/json")
            b, out = await self.send(final, "POST", path, headers, body, stream=True, token_ids=ids)
        except BackendDown as e:
            logger.warning("router: %s", e)
            return unavailable(str(e))
        if out.status_code != 200:
            try:
                content = await out.aread()
            finally:
                await out.aclose()
                self.done(b)
            if out.status_code >= 500:
                return unavailable(f"the {final} instance is unavailable: HTTP {out.status_code}")
            return Response(content, status_code=out.status_code, media_type="application/json")
        return StreamingResponse(self._relay(b, out), media_type="text/event-stream")

    async def _relay(self, b: Instance, resp: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the instance went away mid-stream: say so, then end the stream
            msg = f"the {b.role} instance is unavailable: {type(e).__name__} mid-stream"
            logger.warning("router: %s", msg)
            yield f"data: {json.dumps(error_body(503, msg, code='backend_unavailable'))}\n\n".encode()
        finally:
            await resp.aclose()
            self.done(b)

    async def passthrough(self, path: str, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        role = "decode" if self.disaggregated else "backend"
        try:
            _, r = await self.send(role, "GET", path, headers, place=False)
        except BackendDown as e:
            return unavailable(str(e))
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def health(self) -> Response:
        """200 when every role has an instance up, else 503 naming what is down; the body lists every backend."""
        await self.check_health()
        listing = [{"url": b.url, "role": b.role, "healthy": b.up, "in_flight": b.in_flight,
                    **({"error": b.why_down} if not b.up else {})} for b in self.all_backends]
        down = [p.role for p in self.pools.values() if not any(b.up for b in p.backends)]
        if down:
            why = "; ".join(f"{b.url}: {b.why_down}" for b in self.all_backends if not b.up)
            body = error_body(503, f"the {' and '.join(down)} instance is unavailable: {why}",
                              code="backend_unavailable")
            return JSONResponse({**body, "backends": listing}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"backends": listing})

    async def relayed_counters(self, headers: dict) -> dict[tuple[str, str], float]:
        """{(counter name, backend url): value} of :data:`RELAYED_COUNTERS` from each instance up (summed over its
        engines); an instance that does not answer is left out."""
        async def one(b: Instance) -> list[tuple[tuple[str, str], float]]:
            try:
                r = await self.client.get(b.url + "/metrics", headers=headers, timeout=2.0)
            except httpx.HTTPError:
                return []
            if r.status_code != 200:
                return []
            out: dict[tuple[str, str], float] = {}
            for fam in text_string_to_metric_families(r.text):
                if fam.name in RELAYED_COUNTERS:
                    for s in fam.samples:
                        if s.name.endswith("_total"):
                            out[fam.name, b.url] = out.get((fam.name, b.url), 0.0) + s.value
            return list(out.items())
        got = await asyncio.gather(*(one(b) for b in self.all_backends if b.up))
        return dict(kv for per in got for kv in per)


class RouterCollector(Collector):
    """Where the router placed requests and why, per backend, in the data-parallel metrics' style
    (``pagedllm:dp_routing_*`` with a ``backend`` label for ``engine``), its in-flight counts and backend health."""

    def __init__(self, router: Router):
        self.router = router
        self.relayed: dict[tuple[str, str], float] = {}

    def collect(self) -> Iterable[Metric]:
        labels = ["role", "backend"]
        decisions = CounterMetricFamily(
            "pagedllm:router_routing_decisions", "Requests the router placed on each backend, by decision: "
            "prefix_match (its recorded prefix cache held the longest prefix), load_bound (a prefix match elsewhere "
            "lost to the load bound), least_loaded (no match, or --routing least_loaded).",
            labels=[*labels, "decision"])
        predicted = CounterMetricFamily(
            "pagedllm:router_routing_predicted_hit_tokens", "Prompt tokens the router expected each backend's prefix "
            "cache to serve when it placed requests there (compare the backend's prefix_cache_hits).", labels=labels)
        in_flight = GaugeMetricFamily("pagedllm:router_requests_in_flight",
                                      "Requests the router has in flight on each backend (its load).", labels=labels)
        up = GaugeMetricFamily("pagedllm:router_backend_up", "1 when the backend is taking requests, 0 while it is "
                                                             "routed around (down or restarting).", labels=labels)
        for pool in self.router.pools.values():
            stats = pool.router.stats
            for b in pool.backends:
                lab = [b.role, b.url]
                for decision, per in stats.decisions.items():
                    decisions.add_metric([*lab, decision], per[b.index])
                predicted.add_metric(lab, stats.predicted_hit_tokens[b.index])
                in_flight.add_metric(lab, b.in_flight)
                up.add_metric(lab, 1.0 if b.up else 0.0)
        yield from (decisions, predicted, in_flight, up)
        roles = {b.url: b.role for b in self.router.all_backends}
        for name in RELAYED_COUNTERS:
            fam = CounterMetricFamily(name, f"The backend's own {name.split(':')[1]} counter, relayed (summed over its "
                                            "engines; absent while it is down).", labels=labels)
            for (n, url), v in self.relayed.items():
                if n == name:
                    fam.add_metric([roles[url], url], v)
            yield fam


def build_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="pagedllm router", lifespan=lifespan)
    registry = CollectorRegistry(auto_describe=True)
    collector = RouterCollector(router)
    registry.register(collector)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.generate("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.generate("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.passthrough("/v1/models", request)

    @app.get("/health")
    async def health() -> Response:
        return await router.health()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        collector.relayed = await router.relayed_counters(headers)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
