"""The FastAPI app (``build_app``) and the uvicorn runner (``serve``) behind ``pagedllm serve``.

Lifecycle: the engine is built (model loaded, in its own process) and the render workers are up before uvicorn
binds, so ``/health`` answers only once the server can serve. The app's lifespan binds the event loop to the engine
at startup and stops the engine and render processes after uvicorn's graceful shutdown has drained every in-flight
request (uvicorn handles SIGTERM/SIGINT: stop accepting, finish open responses, then run lifespan exit).

The routes declare their request and response models, so ``/openapi.json`` (and ``/docs``) describe the real API;
responses are still built as plain dicts (see ``protocol.py``). Engine death: with ``--exit-on-engine-failure`` (the
default, as vLLM) every in-flight request gets its error, then the server exits non-zero for a supervisor to restart
it; without it the server stays up answering 503 (``/health`` included).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, Optional, Sequence, Union

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

import pagedllm
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError
from pagedllm.entrypoints.openai.auth import APIKeyMiddleware, add_cors
from pagedllm.entrypoints.openai.docs_assets import add_offline_docs
from pagedllm.engine.cpu_split import parse_cpu_list, pin_front_end
from pagedllm.engine.dp_client import DataParallelEngine, split_cpus
from pagedllm.engine.prefix_router import DPRoutingConfig
from pagedllm.engine.gc_policy import freeze_startup_heap
from pagedllm.entrypoints.openai.errors import APIError, error_body, from_param_error, install_handlers
from pagedllm.entrypoints.openai.grammar_gate import start_grammar_pool, stop_grammar_pool
from pagedllm.entrypoints.openai.limits import Admission, RequestBodyMiddleware, ServerLimits
from pagedllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.entrypoints.openai.pooling_routes import add_pooling_routes
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from pagedllm.entrypoints.openai.protocol_responses import ResponseDeleted, ResponsesRequest, ResponsesResponse
from pagedllm.entrypoints.openai.render_pool import RenderPool, warm_up_forkserver
from pagedllm.entrypoints.openai.response_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ITEMS, ResponseStore
from pagedllm.entrypoints.openai.serving_chat import ChatServing
from pagedllm.entrypoints.openai.serving_common import GIL_SWITCH_INTERVAL_S
from pagedllm.entrypoints.openai.serving_completions import CompletionServing
from pagedllm.entrypoints.openai.serving_mm import (MultiModalInputs, content_texts, looks_multimodal,
    render_processor)
from pagedllm.entrypoints.openai.serving_responses import ResponsesServing
from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager
from pagedllm.multimodal.media import MediaConnector
from pagedllm.lora.request import LoRARequest
from pagedllm.errors import ParamError
from pagedllm.reasoning import ReasoningParserManager
from pagedllm.structured_output import StructuredOutputsConfig

logger = logging.getLogger(__name__)

ENGINE_FAILURE_EXIT_CODE = 1


def _errors(*codes: int) -> dict[int, dict[str, Any]]:
    return {c: {"model": ErrorResponse} for c in codes}


# vLLM answers the LoRA endpoints with plain text; their errors stay JSON (so the route keeps the JSON class)
_PLAIN_OK = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}


#: One server-sent event (before OpenAPI 3.2, a stream's ``schema`` describes each event): ``data`` is a JSON chunk,
#: or ``[DONE]`` last.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer"}}}


def _generation(model) -> dict[int, dict[str, Any]]:
    ok = {"model": model, "description": "The completion; with \"stream\": true, server-sent events (one JSON "
                                         "chunk per \"data:\" line, then \"data: [DONE]\")",
          "content": {"text/event-stream": {"schema": _SSE_EVENT}}}
    return {200: ok, **_errors(400, 401, 404, 408, 413, 429, 499, 500, 503)}


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




def default_served_name(model: Optional[str], model_path: str) -> str:
    """The name clients use when the operator gave none: a hub id as given, a local folder or file by its last
    component only, so responses, errors and ``/metrics`` labels never show the server's file system."""
    if model and not os.path.exists(model) and not os.path.isabs(model):
        return model
    base = os.path.basename(os.path.normpath(model or model_path))
    return base.split(".")[0] if os.path.isfile(model or model_path) else base


def build_app(engine: Union[AsyncEngine, DataParallelEngine], served_model_names: Sequence[str],
              api_key: Optional[Any] = None,
              chat_template: Optional[str] = None, limits: Optional[ServerLimits] = None,
              renderer: Optional[RenderPool] = None, cors: Optional[dict[str, Any]] = None,
              tool_call_parser: Optional[str] = None, enable_auto_tool_choice: bool = False,
              allow_runtime_lora_updating: bool = False, metrics_without_key: bool = False,
              reasoning_parser: Optional[str] = None,
              response_store: Optional[ResponseStore] = None,
              media: Optional[MediaConnector] = None) -> FastAPI:
    """The OpenAI-compatible app around an AsyncEngine; its lifespan binds the event loop and stops the engine.

    ``api_key``: one key or a list of keys (any of them is accepted). ``renderer``: the render worker pool that
    renders templates and (de)tokenises requests (required when the model has a tokenizer). ``cors``: keyword
    arguments of :func:`~pagedllm.entrypoints.openai.auth.add_cors`. ``allow_runtime_lora_updating``: serve
    ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (else they answer 404 saying how to enable them).
    ``metrics_without_key``: with API keys, leave ``/metrics`` open to scrapers (``/health`` always is).
    ``reasoning_parser``: split chat output into ``reasoning_content`` and ``content`` (docs/reasoning.md).
    ``response_store``: where ``/v1/responses`` keeps stored responses (default: a store of the default bounds).
    ``media``: where image URLs may come from and their limits (default: the engine config's allowed path and
    domains, fetch limits at their defaults; docs/multimodal.md).
    """
    names = list(served_model_names)
    for field, value, known in (("tool_call_parser", tool_call_parser, ToolParserManager.list_registered()),
                                ("reasoning_parser", reasoning_parser, ReasoningParserManager.list_registered())):
        if value and value not in known:  # here, not at the first request that needs it
            raise ValueError(f"{field}: {value!r} is not a registered parser; available: {', '.join(known)}")
    limits = limits or ServerLimits()
    metrics = ServerMetrics(engine.replica_stats, names[0], getattr(engine, "routing_stats", None))
    admission = Admission(limits.max_num_queued_reqs, limits.retry_after_s, on_reject=metrics.rejected.inc)
    completions = CompletionServing(engine, names, metrics, chat_template, limits, admission, renderer)
    chat = ChatServing(engine, names, metrics, chat_template, limits, admission, renderer)
    chat.tool_parser, chat.enable_auto_tool_choice = tool_call_parser, enable_auto_tool_choice
    chat.reasoning_parser = reasoning_parser
    chat.mm = mm = MultiModalInputs(engine, media)
    responses = ResponsesServing(engine, names, metrics, chat_template, limits, admission, renderer)
    responses.mm = mm
    responses.tool_parser, responses.enable_auto_tool_choice = tool_call_parser, enable_auto_tool_choice
    responses.store = response_store if response_store is not None else ResponseStore()
    if reasoning_parser:  # (else: the engine config's structured_outputs_config.reasoning_parser, if any)
        responses.reasoning_parser = reasoning_parser
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await engine.start()
        if renderer is not None:
            await renderer.start()
            start_grammar_pool(engine)  # grammar compile workers, in the background (grammar_gate.py)
        freeze_startup_heap()  # (engine/gc_policy.py: no full GC pass may stall the loop for long)
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # render threads get the GIL back quickly (serving_common.py)
        try:
            yield
        finally:
            if renderer is not None:
                await asyncio.to_thread(renderer.shutdown)
            await stop_grammar_pool(engine)
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=pagedllm.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    add_offline_docs(app)  # /docs and /redoc from the installed package's files, not a CDN
    install_handlers(app)
    app.state.engine, app.state.metrics, app.state.admission = engine, metrics, admission

    @app.get("/health", response_class=Response,
             responses={200: {"description": "The engine is running (empty body)"}, **_errors(503)})
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(error_body(503, f"engine is not running: {engine.error!r}"), status_code=503)
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    # ``root`` is a served name, never the folder the weights came from: file-system paths stay in the server's log.
    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "pagedllm", "root": names[0],
                "parent": None, "max_model_len": engine.max_model_len}

    def lora_card(lora: LoRARequest) -> dict:
        return {"id": lora.lora_name, "object": "model", "created": created, "owned_by": "pagedllm",
                "root": lora.lora_name, "parent": names[0], "max_model_len": engine.max_model_len}

    @app.get("/v1/models", response_model=ModelList, responses=_errors(401))
    async def models() -> dict:
        return {"object": "list", "data": [card(n) for n in names]
                + [lora_card(r) for r in getattr(engine, "loras", {}).values()]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_errors(401, 404))
    async def model(model_id: str) -> dict:
        lora = completions.check_model(model_id)
        return lora_card(lora) if lora is not None else card(model_id)

    def check_runtime_lora() -> None:
        if not allow_runtime_lora_updating:
            raise APIError(404, "runtime LoRA updating is disabled; start the server with "
                                "--allow-runtime-lora-updating (and --enable-lora) to use this endpoint",
                           code="runtime_lora_updating_disabled")

    @app.post("/v1/load_lora_adapter", responses={**_PLAIN_OK, **_errors(400, 401, 404, 503)})
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        check_runtime_lora()
        if body.lora_name in names:
            raise APIError(400, f"lora_name: {body.lora_name!r} is the base model's name", param="lora_name")
        if body.lora_name in engine.loras:
            raise APIError(400, f"lora_name: an adapter named {body.lora_name!r} is already loaded",
                           param="lora_name")
        try:
            await engine.add_lora(LoRARequest(body.lora_name, engine.next_lora_id(), body.lora_path))
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        except Exception as e:  # noqa: BLE001 - whatever the folder holds: one answer, the detail in the log
            # One message for a missing folder, a file, no adapter_config.json, bad JSON or an unsupported adapter:
            # anything more would let a client map the server's file system (issue 34).
            logger.warning("load_lora_adapter %r from %r failed: %s", body.lora_name, body.lora_path, e)
            raise APIError(400, "lora_path: no loadable LoRA adapter at this path (the server log has the reason)",
                           param="lora_path", code="invalid_lora_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses={**_PLAIN_OK, **_errors(400, 401, 404, 503)})
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        check_runtime_lora()
        if body.lora_name not in engine.loras:
            raise APIError(404, f"lora_name: no adapter named {body.lora_name!r} is loaded", param="lora_name",
                           code="model_not_found")
        try:
            await engine.remove_lora(body.lora_name)
        except ParamError as e:
            raise from_param_error(e) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions", response_model=None, response_class=JSONResponse,
              responses=_generation(CompletionResponse))
    async def create_completion(body: CompletionRequest, raw: Request):
        pooling.check_generation("/v1/completions")
        return await completions.create(body, raw)

    @app.post("/v1/chat/completions", response_model=None, response_class=JSONResponse,
              responses=_generation(ChatCompletionResponse))
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        pooling.check_generation("/v1/chat/completions")
        return await chat.create(body, raw)

    # OpenAI's Responses API (serving_responses.py); stored responses live in responses.store (response_store.py)
    @app.post("/v1/responses", response_model=None, response_class=JSONResponse,
              responses=_generation(ResponsesResponse))
    async def create_response(body: ResponsesRequest, raw: Request):
        pooling.check_generation("/v1/responses")
        return await responses.create(body, raw)

    @app.get("/v1/responses/{response_id}", response_model=ResponsesResponse, responses=_errors(401, 404))
    async def retrieve_response(response_id: str) -> dict:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses=_errors(401, 404))
    async def delete_response(response_id: str) -> dict:
        return responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel", response_model=ResponsesResponse,
              responses=_errors(400, 401, 404))
    async def cancel_response(response_id: str) -> dict:
        return responses.cancel(response_id)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 404, 408, 413, 429, 503))
    async def tokenize(body: TokenizeRequest) -> dict:
        start = time.monotonic()
        completions.check_model(body.model)
        completions.need_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt or messages", param="prompt")
        # The limits of a completion's prompt: text no prompt that fits the model could be is refused before a
        # render worker tokenises it, and the token count must fit max_model_len.
        if body.messages is not None:
            messages = (await mm.parse([m.to_template_dict() for m in body.messages])).messages
            completions.check_text_size(content_texts(messages), "messages")
        else:
            completions.check_text_size([body.prompt], "prompt")
        ticket = completions.admit(1)
        try:
            if body.messages is not None:
                ids = await completions.render_chat(messages, chat_template, body.add_generation_prompt, False, None,
                                                    start)
            else:
                ids = (await completions.encode([body.prompt], body.add_special_tokens, "prompt", start))[0]
        finally:
            ticket.release()
        if len(ids) > engine.max_model_len:
            field = "prompt" if body.prompt is not None else "messages"
            raise APIError(400, f"{field}: this model's maximum context length is {engine.max_model_len} tokens, but "
                                f"the prompt has {len(ids)} tokens", param=field, code="context_length_exceeded")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": list(ids), "token_strs": None}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(400, 404, 408, 413, 429, 503))
    async def detokenize(body: DetokenizeRequest) -> dict:
        start = time.monotonic()
        completions.check_model(body.model)
        tok = completions.need_tokenizer()
        if len(body.tokens) > engine.max_model_len:  # a completion's bound on prompt ids, counted before any work
            raise APIError(400, f"tokens: at most {engine.max_model_len} ids (max_model_len), got {len(body.tokens)}",
                           param="tokens", code="context_length_exceeded")
        vocab = len(tok)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        ticket = completions.admit(1)
        try:
            return {"prompt": (await completions.decode([body.tokens], "tokens", start))[0]}
        finally:
            ticket.release()

    # /v1/embeddings, /pooling, /classify, /score, /rerank (pooling_routes.py); completions and chat refuse a
    # pooling model through it
    pooling = add_pooling_routes(app, engine, names, metrics, chat_template, limits, admission, renderer)

    @app.get("/metrics", response_class=Response, responses={200: {"description": "Prometheus text format",
                                          "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    _plain_openapi = app.openapi

    def openapi() -> dict:
        """FastAPI's schema minus its default 422 answers: validation failures are 400s here (OpenAI's shape)."""
        if app.openapi_schema is None:
            schema = _plain_openapi()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    if isinstance(op, dict):
                        op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    # Outermost last: CORS, then the API key (no body is read for a caller without one), then the body limit.
    small = limits.tokenize_body_bytes(engine.max_model_len)
    app.add_middleware(RequestBodyMiddleware, max_bytes=limits.max_request_body_bytes,
                       max_json_depth=limits.max_json_depth, route_max_bytes={"/tokenize": small, "/detokenize": small})
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if keys:
        app.add_middleware(APIKeyMiddleware, api_keys=keys, open_metrics=metrics_without_key)
    add_cors(app, **(cors or {}))
    return app


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[Any] = None,
          served_model_names: Optional[Sequence[str]] = None, chat_template: Optional[str] = None,
          uvicorn_log_level: str = "info", timeout_graceful_shutdown: Optional[float] = None,
          stream_interval: int = 1, engine_cpus: Optional[str] = None, limits: Optional[ServerLimits] = None,
          render_workers: int = 2, exit_on_engine_failure: bool = True,
          cors: Optional[dict[str, Any]] = None, tool_call_parser: Optional[str] = None,
          enable_auto_tool_choice: bool = False, lora_modules: Sequence[LoRARequest] = (),
          allow_runtime_lora_updating: bool = False, data_parallel_size: int = 1,
          dp_routing: Optional[DPRoutingConfig] = None,
          metrics_without_key: bool = False, reasoning_parser: Optional[str] = None,
          max_stored_responses: int = DEFAULT_MAX_ITEMS, max_stored_responses_bytes: int = DEFAULT_MAX_BYTES,
          media: Optional[MediaConnector] = None) -> int:
    """Load the model, then serve until SIGTERM/SIGINT; returns the process exit code.

    ``engine_cpus`` (a CPU list, "0-6"): the engine process runs there and this process on the remaining CPUs.
    ``data_parallel_size`` > 1: that many engine replicas (see ``dp_client.py``), the engine CPUs (default: all this
    process may use) split evenly among them, requests placed by ``dp_routing`` (default: cache-aware).
    ``exit_on_engine_failure``: if the engine process dies, fail the in-flight requests, then exit with code 1.
    ``reasoning_parser``: the server splits reasoning from content, and the engine applies grammars after it
    (``structured_outputs_config.reasoning_parser``).
    ``max_stored_responses`` / ``max_stored_responses_bytes``: the bounds of /v1/responses' store (LRU).
    ``media``: image URL sources and limits (``build_app``).
    """
    template = load_chat_template(chat_template)
    if reasoning_parser:
        so = StructuredOutputsConfig.parse(config.structured_outputs_config)
        config = replace(config, structured_outputs_config=replace(so, reasoning_parser=reasoning_parser))
    if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ParamError("data_parallel_size", f"must be an integer >= 1, got {data_parallel_size!r}")
    cpus = parse_cpu_list(engine_cpus) if engine_cpus is not None else None
    replica_cpus = None
    if data_parallel_size > 1:
        replica_cpus = split_cpus(sorted(cpus if cpus else os.sched_getaffinity(0)), data_parallel_size)
        cpus = frozenset().union(*replica_cpus)
    # imports transformers in the background while the engine loads the model
    warm_up_forkserver(images=looks_multimodal(config.model))
    mm_loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-mm-processor")
    mm_processor = mm_loader.submit(render_processor, config)  # a VLM's processor for the render workers, meanwhile
    mm_loader.shutdown(wait=False)
    # Starts the engine process(es) and waits until the model is loaded.
    engine = (DataParallelEngine(config, replica_cpus, stream_interval, lora_modules, dp_routing) if replica_cpus
              else AsyncEngine(config, stream_interval, cpus, lora_modules))
    renderer = None
    try:
        if engine.tokenizer is not None:
            renderer = RenderPool(engine.tokenizer, render_workers,
                                  max_growth_bytes=(limits or ServerLimits()).render_worker_max_growth_bytes,
                                  mm_processor=mm_processor.result())  # images are processed by the workers
            renderer.wait_ready()
    except BaseException:
        engine.shutdown()
        raise
    if cpus:
        front = pin_front_end(cpus)
        if renderer is not None:
            renderer.pin(front)
        logger.info("HTTP process on CPUs %s%s", ",".join(map(str, sorted(front))),
                    " (shared with the engine: none left)" if front & cpus else "")
    if not served_model_names:
        served_model_names = [default_served_name(config.model, engine.model_path)]
    app = build_app(engine, served_model_names, api_key, template, limits, renderer, cors, tool_call_parser,
                    enable_auto_tool_choice, allow_runtime_lora_updating, metrics_without_key,
                    reasoning_parser or None,
                    response_store=ResponseStore(max_stored_responses, max_stored_responses_bytes), media=media)
    ucfg = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level,
                          timeout_graceful_shutdown=timeout_graceful_shutdown, timeout_keep_alive=5)
    server = uvicorn.Server(ucfg)
    exit_code = {"code": 0}

    if exit_on_engine_failure:
        def on_dead(err: BaseException) -> None:
            logger.error("engine failed (%s): in-flight requests were failed; exiting (--exit-on-engine-failure)",
                         err)
            exit_code["code"] = ENGINE_FAILURE_EXIT_CODE
            server.should_exit = True
            # Open responses already got their error; if a connection still holds the drain up, do not wait.
            force = threading.Timer(3.0, lambda: setattr(server, "force_exit", True))
            force.daemon = True
            force.start()
            watchdog = threading.Timer(4.5, lambda: os._exit(ENGINE_FAILURE_EXIT_CODE))
            watchdog.daemon = True
            watchdog.start()

        engine.on_dead = on_dead
    logger.info("serving %s on http://%s:%d", ", ".join(served_model_names), host, port)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to the previous handler; make that a no-op so
    # a drained shutdown exits 0 instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        if renderer is not None:
            renderer.shutdown()
    if exit_code["code"]:
        return exit_code["code"]
    return 0 if server.started else 1
