"""``pagedllm router --prefill URL --decode URL``: prefill/decode disaggregation's proxy (vLLM's
``disagg_proxy_server`` shape). Each ``/v1/completions`` or ``/v1/chat/completions`` request runs its prompt on the
prefill instance (``max_tokens=1``, not streamed, ``kv_transfer_params: {"do_remote_decode": true}``), then the
original request, with the ``kv_transfer_params`` the prefill answer carried, on the decode instance, whose answer
(streamed through when asked) is the client's. A backend that is down, restarting or too slow is a 503 in the OpenAI
error shape, never a hang: connects are retried a bounded number of times (a server restarting refuses them), every
call has a timeout. docs/kv-offload.md ("Prefill/decode disaggregation") is the guide."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.errors import error_body

logger = logging.getLogger(__name__)

FORWARDED_HEADERS = ("authorization", "x-request-id")


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


class Router:
    def __init__(self, prefill_url: str, decode_url: str, timeout_s: float = 300.0, connect_retries: int = 5,
                 retry_delay_s: float = 0.5):
        self.urls = {"prefill": prefill_url.rstrip("/"), "decode": decode_url.rstrip("/")}
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)
        self.connect_retries = connect_retries
        self.retry_delay_s = retry_delay_s
        self.client: Optional[httpx.AsyncClient] = None

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=1000))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def send(self, which: str, method: str, path: str, headers: dict, body: Any = None,
                   stream: bool = False) -> httpx.Response:
        """One call to a backend; a refused connection (down or restarting) is retried ``connect_retries`` times."""
        req = self.client.build_request(method, self.urls[which] + path, headers=headers,
                                        json=body if body is not None else None)
        for attempt in range(self.connect_retries + 1):
            try:
                return await self.client.send(req, stream=stream)
            except httpx.ConnectError as e:
                if attempt == self.connect_retries:
                    raise BackendDown(which, f"connection refused at {self.urls[which]} ({e})") from None
                await asyncio.sleep(self.retry_delay_s)
            except httpx.TimeoutException as e:
                raise BackendDown(which, f"no answer within the timeout ({type(e).__name__})") from None
            except httpx.HTTPError as e:
                raise BackendDown(which, f"{type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")

    async def generate(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return JSONResponse(error_body(400, "the body must be a JSON object"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body(400, "the body must be a JSON object"), status_code=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            pre = await self.send("prefill", "POST", path, headers, prefill_body(body))
            if pre.status_code != 200:  # the client's request is bad (4xx: P's answer says why) or P failed
                if pre.status_code < 500:
                    return Response(pre.content, status_code=pre.status_code, media_type="application/json")
                raise BackendDown("prefill", f"HTTP {pre.status_code}: {pre.text[:300]}")
            try:
                params = pre.json().get("kv_transfer_params")
            except (ValueError, AttributeError):
                raise BackendDown("prefill", f"not a JSON object: {pre.text[:200]!r}") from None
            dbody = dict(body, kv_transfer_params=params) if params else body
            if not body.get("stream"):
                dec = await self.send("decode", "POST", path, headers, dbody)
                if dec.status_code >= 500:
                    raise BackendDown("decode", f"HTTP {dec.status_code}: {dec.text[:300]}")
                return Response(dec.content, status_code=dec.status_code, media_type="application/json")
            dec = await self.send("decode", "POST", path, headers, dbody, stream=True)
        except BackendDown as e:
            logger.warning("router: %s", e)
            return unavailable(str(e))
        if dec.status_code != 200:
            content = await dec.aread()
            await dec.aclose()
            if dec.status_code >= 500:
                return unavailable(f"the decode instance is unavailable: HTTP {dec.status_code}")
            return Response(content, status_code=dec.status_code, media_type="application/json")
        return StreamingResponse(self._relay(dec), media_type="text/event-stream")

    async def _relay(self, resp: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the decode instance went away mid-stream: say so, then end the stream
            msg = f"the decode instance is unavailable: {type(e).__name__} mid-stream"
            logger.warning("router: %s", msg)
            yield f"data: {json.dumps(error_body(503, msg, code='backend_unavailable'))}\n\n".encode()
        finally:
            await resp.aclose()

    async def passthrough(self, which: str, path: str, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            r = await self.send(which, "GET", path, headers)
        except BackendDown as e:
            return unavailable(str(e))
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def health(self, request: Request) -> Response:
        for which in ("prefill", "decode"):
            try:
                r = await self.send(which, "GET", "/health", {})
            except BackendDown as e:
                return unavailable(str(e))
            if r.status_code != 200:
                return unavailable(f"the {which} instance is unhealthy: HTTP {r.status_code}")
        return Response(status_code=200)


def build_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="pagedllm P/D router", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.generate("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.generate("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.passthrough("decode", "/v1/models", request)

    @app.get("/health")
    async def health(request: Request) -> Response:
        return await router.health(request)

    return app
