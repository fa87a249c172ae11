"""``pagedllm serve [MODEL] --device cpu --host 127.0.0.1 --port 8000 ...``: the OpenAI-compatible server.

Flag names follow ``vllm serve``. The default host is loopback: exposing the server is an explicit choice.
"""

from __future__ import annotations

import argparse
import logging
import os

from pagedllm.commands.engine_args import add_engine_args, engine_config


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default model: embedded SmolLM2-135M-Instruct)")
    add_engine_args(p, model_positional=True)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDLLM_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported in responses (default: MODEL)")
    p.add_argument("--chat-template", default=None, help="Jinja chat template, or a file holding one")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--timeout-graceful-shutdown", type=float, default=None,
                   help="seconds to wait for in-flight requests on SIGTERM (default: until they finish)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="send a streamed choice only every N tokens (first token and end at once); default 1")
    p.add_argument("--engine-cpus", default=None, metavar="LIST",
                   help="CPUs for the engine process (taskset syntax, e.g. 0-6), one torch thread each; the HTTP "
                        "process runs on the other CPUs (default: both on every CPU)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from pagedllm.entrypoints.api_server import serve
    except ImportError as e:
        raise SystemExit(f"pagedllm serve needs the serving extras ({e.name} is missing): "
                         "pip install 'pagedllm[serve]'") from None

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    return serve(engine_config(args), host=args.host, port=args.port, api_key=args.api_key,
                 served_model_names=args.served_model_name, chat_template=args.chat_template,
                 uvicorn_log_level=args.uvicorn_log_level, timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                 stream_interval=args.stream_interval, engine_cpus=args.engine_cpus)
