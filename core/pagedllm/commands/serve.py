"""``pagedllm serve [MODEL] --device cpu --host 127.0.0.1 --port 8000 ...``: the OpenAI-compatible server.

Flag names follow ``vllm serve`` where vLLM has the flag (``--api-key``, ``--allowed-origins``,
``--trust-request-chat-template``, ``--max-num-queued-reqs``, ...). Defaults are the safe ones: loopback only, CORS
closed, request-level chat templates refused, a bounded queue and body size (see docs/security.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
from dataclasses import replace

from pagedllm.commands.engine_args import add_engine_args, engine_config, lora_modules
from pagedllm.engine.prefix_router import ROUTING_POLICIES, DPRoutingConfig
from pagedllm.entrypoints.openai.limits import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_JSON_DEPTH,
                                                DEFAULT_MAX_NUM_QUEUED_REQS, DEFAULT_RENDER_WORKER_MAX_GROWTH,
                                                DEFAULT_TEMPLATE_RENDER_TIMEOUT, ServerLimits)
from pagedllm.entrypoints.openai.response_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ITEMS
from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager
from pagedllm.errors import ParamError
from pagedllm.multimodal.media import (DEFAULT_FETCH_TIMEOUT, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_MEDIA_BYTES,
                                       DEFAULT_MAX_REDIRECTS, MediaConnector)
from pagedllm.reasoning import ReasoningParserManager


def _str_list(value: str) -> list[str]:
    """A JSON list (vLLM's form, '["http://a"]') or a comma-separated list."""
    value = value.strip()
    if value.startswith("["):
        out = json.loads(value)
        if not isinstance(out, list) or not all(isinstance(x, str) for x in out):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return out
    return [v.strip() for v in value.split(",") if v.strip()]


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default model: embedded SmolLM2-135M-Instruct)")
    add_engine_args(p, model_positional=True)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health; several keys allowed (also "
                        "$PAGEDLLM_API_KEY and --api-key-file)")
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="file with API keys, one a line")
    p.add_argument("--allow-metrics-without-key", action="store_true",
                   help="with API keys, leave /metrics open to scrapers (default: it needs a key too)")
    p.add_argument("--allowed-origins", type=_str_list, default=None,
                   help="CORS origins allowed (JSON list or comma-separated); default: none (CORS closed)")
    p.add_argument("--allowed-methods", type=_str_list, default=None, help="CORS methods (default: all, once "
                                                                             "--allowed-origins is set)")
    p.add_argument("--allowed-headers", type=_str_list, default=None, help="CORS headers (default: all, once "
                                                                             "--allowed-origins is set)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported in responses (default: MODEL as given for a "
                        "hub id; a local model's folder or file name, never its path)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served under their names (needs --enable-lora); clients select one with "
                        "model=NAME")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="enable /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); default off: anyone who can reach the API could load files")
    p.add_argument("--chat-template", default=None, help="Jinja chat template, or a file holding one")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template in requests (default: refused with 400; a template is code)")
    p.add_argument("--template-render-timeout", type=float, default=DEFAULT_TEMPLATE_RENDER_TIMEOUT,
                   metavar="SECONDS", help="time limit for rendering and tokenising one request, in a render worker "
                                           f"process (default {DEFAULT_TEMPLATE_RENDER_TIMEOUT:g})")
    p.add_argument("--render-workers", type=int, default=2,
                   help="render worker processes (templates, tokenisation); default 2")
    p.add_argument("--render-worker-max-growth-mb", type=int, default=DEFAULT_RENDER_WORKER_MAX_GROWTH >> 20,
                   metavar="MIB", help="a render worker whose resident memory grew more than this since its start is "
                                       "replaced after its job; 0 = never (default "
                                       f"{DEFAULT_RENDER_WORKER_MAX_GROWTH >> 20})")
    p.add_argument("--max-json-depth", type=int, default=DEFAULT_MAX_JSON_DEPTH, metavar="N",
                   help="request bodies nesting JSON arrays/objects deeper than this get 400 before they are parsed "
                        f"(default {DEFAULT_MAX_JSON_DEPTH})")
    p.add_argument("--max-num-queued-reqs", type=int, default=DEFAULT_MAX_NUM_QUEUED_REQS, metavar="N",
                   help="in-flight sequences admitted (waiting + running; n/best_of count each); beyond it 429 with "
                        f"Retry-After; 0 = unbounded (default {DEFAULT_MAX_NUM_QUEUED_REQS})")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="per-request deadline: past it the request is aborted (408) and its KV blocks freed "
                        "(default: none)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                   help=f"larger request bodies get 413 before they are parsed (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--exit-on-engine-failure", action=argparse.BooleanOptionalAction, default=True,
                   help="if the engine process dies, fail in-flight requests and exit with code 1 so a supervisor "
                        "restarts the server (default); --no-exit-on-engine-failure keeps serving 503s")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--timeout-graceful-shutdown", type=float, default=None,
                   help="seconds to wait for in-flight requests on SIGTERM (default: until they finish)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="send a streamed choice only every N tokens (first token and end at once); default 1")
    p.add_argument("--engine-cpus", default=None, metavar="LIST",
                   help="CPUs for the engine process (taskset syntax, e.g. 0-6), one torch thread each; the HTTP "
                        "process runs on the other CPUs (default: both on every CPU)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="engine replicas, each a process with a full model copy and its own KV cache, behind this "
                        "server; requests go by --dp-routing (docs/distributed.md). On CPUs the engine CPUs "
                        "(--engine-cpus, default all) are split evenly among them; default 1")
    p.add_argument("--dp-routing", default=DPRoutingConfig.policy, choices=ROUTING_POLICIES,
                   help="data parallel: cache_aware (default) sends a request to the replica most likely to hold "
                        "the longest prefix of its prompt in its prefix cache, within the load bound below; "
                        "least_loaded uses the fewest unfinished requests alone")
    p.add_argument("--dp-balance-abs-threshold", type=int, default=DPRoutingConfig.balance_abs_threshold,
                   metavar="N", help="cache_aware: a prefix match loses to load when its replica holds more than N "
                                     "requests above the least loaded one ... (default %(default)s)")
    p.add_argument("--dp-balance-rel-threshold", type=float, default=DPRoutingConfig.balance_rel_threshold,
                   metavar="X", help="... and more than X times as many (default %(default)s)")
    p.add_argument("--tool-call-parser", default=None, choices=ToolParserManager.list_registered(),
                   help="parse tool calls out of the model's text for tool_choice=auto: "
                        + ", ".join(ToolParserManager.list_registered()) + " (docs/structured_outputs.md)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice=auto (needs --tool-call-parser)")
    p.add_argument("--reasoning-parser", default=None, choices=ReasoningParserManager.list_registered(),
                   help="split chat output into reasoning_content and content; grammars apply after the "
                        "reasoning (docs/reasoning.md)")
    p.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_ITEMS, metavar="N",
                   help="/v1/responses keeps at most this many stored responses (least recently used go first; "
                        f"default {DEFAULT_MAX_ITEMS}); 0 stores none")
    p.add_argument("--max-stored-responses-mb", type=int, default=DEFAULT_MAX_BYTES >> 20, metavar="MIB",
                   help="/v1/responses keeps at most this many MiB of stored responses, as JSON (least recently "
                        f"used go first; default {DEFAULT_MAX_BYTES >> 20})")
    p.add_argument("--disable-media-fetch", action="store_true",
                   help="refuse http(s) image URLs (data: URLs, and file: URLs under --allowed-local-media-path, "
                        "still work); docs/multimodal.md")
    p.add_argument("--media-fetch-timeout", type=float, default=DEFAULT_FETCH_TIMEOUT, metavar="SECONDS",
                   help=f"time limit of one image fetch, redirects included (default {DEFAULT_FETCH_TIMEOUT:g})")
    p.add_argument("--max-media-bytes", type=int, default=DEFAULT_MAX_MEDIA_BYTES, metavar="BYTES",
                   help=f"largest encoded image taken from any URL (default {DEFAULT_MAX_MEDIA_BYTES})")
    p.add_argument("--media-max-redirects", type=int, default=DEFAULT_MAX_REDIRECTS, metavar="N",
                   help=f"redirects an image fetch may follow (default {DEFAULT_MAX_REDIRECTS})")
    p.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS, metavar="N",
                   help="images with more pixels are refused before they are decoded (default "
                        f"{DEFAULT_MAX_IMAGE_PIXELS}, PIL's own limit)")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if args.template_render_timeout <= 0:
        raise ParamError("template_render_timeout", f"must be > 0, got {args.template_render_timeout}")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ParamError("request_timeout", f"must be > 0, got {args.request_timeout}")
    if args.max_num_queued_reqs < 0:
        raise ParamError("max_num_queued_reqs", f"must be >= 0, got {args.max_num_queued_reqs}")
    if args.max_request_body_bytes < 1024:
        raise ParamError("max_request_body_bytes", f"must be >= 1024, got {args.max_request_body_bytes}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ParamError("enable_auto_tool_choice", "needs --tool-call-parser")
    if args.data_parallel_size < 1:
        raise ParamError("data_parallel_size", f"must be >= 1, got {args.data_parallel_size}")
    dp_routing(args)  # a bad threshold fails before the model loads
    if args.render_workers < 1:
        raise ParamError("render_workers", f"must be >= 1, got {args.render_workers}")
    if args.render_worker_max_growth_mb < 0:
        raise ParamError("render_worker_max_growth_mb", f"must be >= 0, got {args.render_worker_max_growth_mb}")
    if args.max_json_depth < 2:
        raise ParamError("max_json_depth", f"must be >= 2, got {args.max_json_depth}")
    if args.max_stored_responses < 0 or args.max_stored_responses_mb < 0:
        raise ParamError("max_stored_responses", "the response store's bounds must be >= 0")
    _check_port(args.host, args.port)


def dp_routing(args: argparse.Namespace) -> DPRoutingConfig:
    return DPRoutingConfig(args.dp_routing, args.dp_balance_abs_threshold, args.dp_balance_rel_threshold)


def _check_port(host: str, port: int) -> None:
    """Fail before the model loads (seconds to minutes) when the address cannot be bound."""
    if not 0 <= port <= 65535:
        raise ParamError("port", f"must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ParamError("host", f"cannot resolve {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is not "in use"
        try:
            s.bind(addr)
        except OSError as e:
            raise ParamError("port", f"cannot listen on {host}:{port} ({e.strerror}); is another server running "
                                     "there? choose another --port") from None


def run(args: argparse.Namespace) -> int:
    try:
        from pagedllm.entrypoints.openai.api_server import serve  # heavy: fastapi, uvicorn
        from pagedllm.entrypoints.openai.auth import load_api_keys  # heavy: fastapi
    except ImportError as e:
        raise SystemExit(f"pagedllm serve needs the serving extras ({e.name} is missing): "
                         "pip install 'pagedllm[serve]'") from None

    _check(args)
    loras = lora_modules(args.lora_modules, args.enable_lora)
    if args.allow_runtime_lora_updating and not args.enable_lora:
        raise ParamError("allow_runtime_lora_updating", "needs --enable-lora")
    try:
        keys = load_api_keys(args.api_key, args.api_key_file)
    except (OSError, ValueError) as e:
        raise ParamError("api_key", str(e)) from None
    limits = ServerLimits(max_request_body_bytes=args.max_request_body_bytes,
                          max_num_queued_reqs=args.max_num_queued_reqs or None,
                          request_timeout=args.request_timeout,
                          template_render_timeout=args.template_render_timeout,
                          trust_request_chat_template=args.trust_request_chat_template,
                          max_json_depth=args.max_json_depth,
                          render_worker_max_growth_bytes=(args.render_worker_max_growth_mb << 20) or None)
    media = MediaConnector(args.allowed_local_media_path, args.allowed_media_domains,  # checked before loading
                           enable_fetch=not args.disable_media_fetch, fetch_timeout=args.media_fetch_timeout,
                           max_bytes=args.max_media_bytes, max_redirects=args.media_max_redirects,
                           max_image_pixels=args.max_image_pixels)
    cors = dict(allowed_origins=args.allowed_origins, allow_credentials=args.allow_credentials,
                allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    config, names = engine_config(args), args.served_model_name
    if config.model is not None:  # a Hub id is downloaded once, here, not by each engine process; clients keep its id
        from pagedllm.entrypoints.openai.api_server import default_served_name  # heavy: fastapi
        from pagedllm.models.paths import resolve_model_path  # heavy: the model package

        path = resolve_model_path(config.model)
        config, names = replace(config, model=path), names or [default_served_name(config.model, path)]
    return serve(config, host=args.host, port=args.port, api_key=keys,
                 served_model_names=names, chat_template=args.chat_template,
                 uvicorn_log_level=args.uvicorn_log_level, timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                 stream_interval=args.stream_interval, engine_cpus=args.engine_cpus, limits=limits,
                 render_workers=args.render_workers, exit_on_engine_failure=args.exit_on_engine_failure, cors=cors,
                 tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                 lora_modules=loras, allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                 data_parallel_size=args.data_parallel_size, dp_routing=dp_routing(args),
                 metrics_without_key=args.allow_metrics_without_key,
                 reasoning_parser=args.reasoning_parser,
                 max_stored_responses=args.max_stored_responses,
                 max_stored_responses_bytes=args.max_stored_responses_mb << 20, media=media)
