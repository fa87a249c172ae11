"""``pagedllm router --prefill URL --decode URL``: the prefill/decode disaggregation proxy
(``pagedllm.entrypoints.router``; docs/kv-offload.md)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("router",
                       help="proxy that runs each request's prefill on one instance, its decode on another")
    p.add_argument("--prefill", required=True, help="base URL of the kv_producer instance (http://127.0.0.1:8100)")
    p.add_argument("--decode", required=True, help="base URL of the kv_consumer instance (http://127.0.0.1:8200)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a backend call may take (then a 503)")
    p.add_argument("--connect-retries", type=int, default=5,
                   help="retries (0.5 s apart) of a refused connection, e.g. a backend restarting")
    p.add_argument("--uvicorn-log-level", default="warning")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from pagedllm.entrypoints.router import Router, build_app

    app = build_app(Router(args.prefill, args.decode, args.timeout, args.connect_retries))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
