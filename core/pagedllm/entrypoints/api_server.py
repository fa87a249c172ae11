"""The FastAPI app (``build_app``) and the uvicorn runner (``serve``) behind ``pagedllm serve``.

Lifecycle: the engine is built (model loaded, in its own process) before uvicorn binds, so ``/health`` answers only
once the server can serve. The app's lifespan binds the event loop to the engine at startup and stops the engine
process after uvicorn's graceful shutdown has drained every in-flight request (uvicorn handles SIGTERM/SIGINT: stop
accepting, finish open responses, then run lifespan exit).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import os
import signal
import time
from contextlib import asynccontextmanager
from typing import Optional, Sequence, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse, Response

import pagedllm
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.async_engine import AsyncEngine
from pagedllm.entrypoints.cpu_split import parse_cpu_list, pin_front_end
from pagedllm.entrypoints.errors import APIError, error_body, install_handlers, validation_error
from pagedllm.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagedllm.entrypoints.serving_chat import ChatServing, render_chat
from pagedllm.entrypoints.serving_completions import CompletionServing

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


class APIKeyMiddleware:
    """Plain ASGI middleware (no response buffering, so SSE streams pass untouched): ``/v1/*`` needs the key."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        got = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                got = v
                break
        if hmac.compare_digest(got, self.expected):
            return await self.app(scope, receive, send)
        msg = ("You didn't provide an API key: pass it as 'Authorization: Bearer <key>'." if not got
               else "Incorrect API key provided.")
        body = json.dumps(error_body(401, msg, code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


async def parse_body(raw: Request, model: type[M]) -> M:
    """JSON body -> pydantic model whatever the Content-Type (curl -d sends form-urlencoded); failures are 400s."""
    data = await raw.body()
    try:
        obj = json.loads(data) if data else None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """``--chat-template``: a file path or the Jinja template itself (as vLLM accepts)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def build_app(engine: AsyncEngine, served_model_names: Sequence[str], api_key: Optional[str] = None,
              chat_template: Optional[str] = None) -> FastAPI:
    """The OpenAI-compatible app around an AsyncEngine; its lifespan binds the event loop and stops the engine."""
    names = list(served_model_names)
    metrics = ServerMetrics(engine.stats, names[0])
    completions = CompletionServing(engine, names, metrics, chat_template)
    chat = ChatServing(engine, names, metrics, chat_template)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await engine.start()
        # What startup allocated (torch, FastAPI, the tokenizer) lives for good: keep it out of every GC pass, which
        # otherwise walks those millions of objects while outputs are being unpickled (vLLM freezes them too).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=pagedllm.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)
    app.state.engine, app.state.metrics = engine, metrics

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(error_body(503, f"engine is not running: {engine.error!r}"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "pagedllm", "root": engine.model_path,
             "parent": None, "max_model_len": engine.max_model_len} for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        completions.check_model(model_id)
        return {"id": model_id, "object": "model", "created": created, "owned_by": "pagedllm",
                "root": engine.model_path, "parent": None, "max_model_len": engine.max_model_len}

    @app.post("/v1/completions")
    async def create_completion(raw: Request):
        return await completions.create(await parse_body(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request):
        return await chat.create(await parse_body(raw, ChatCompletionRequest), raw)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict:
        body = await parse_body(raw, TokenizeRequest)
        completions.check_model(body.model)
        tok = completions.need_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            ids = render_chat(tok, [m.to_template_dict() for m in body.messages], chat_template,
                              body.add_generation_prompt)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": list(ids), "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict:
        body = await parse_body(raw, DetokenizeRequest)
        completions.check_model(body.model)
        tok = completions.need_tokenizer()
        vocab = len(tok)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": tok.decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
          served_model_names: Optional[Sequence[str]] = None, chat_template: Optional[str] = None,
          uvicorn_log_level: str = "info", timeout_graceful_shutdown: Optional[float] = None,
          stream_interval: int = 1, engine_cpus: Optional[str] = None) -> int:
    """Load the model, then serve until SIGTERM/SIGINT; returns the process exit code.

    ``engine_cpus`` (a CPU list, "0-6"): the engine process runs there and this process on the remaining CPUs.
    """
    import uvicorn

    template = load_chat_template(chat_template)
    cpus = parse_cpu_list(engine_cpus) if engine_cpus is not None else None
    engine = AsyncEngine(config, stream_interval, cpus)  # starts the engine process, waits until the model is loaded
    if cpus:
        front = pin_front_end(cpus)
        logger.info("HTTP process on CPUs %s%s", ",".join(map(str, sorted(front))),
                    " (shared with the engine: none left)" if front & cpus else "")
    if not served_model_names:
        served_model_names = [config.model if config.model else
                              os.path.basename(engine.model_path).split(".")[0]]
    app = build_app(engine, served_model_names, api_key, template)
    ucfg = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level,
                          timeout_graceful_shutdown=timeout_graceful_shutdown, timeout_keep_alive=5)
    server = uvicorn.Server(ucfg)
    logger.info("serving %s on http://%s:%d", ", ".join(served_model_names), host, port)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to the previous handler; make that a no-op so
    # a drained shutdown exits 0 instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1
