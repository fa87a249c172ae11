"""``pagedllm router``: one OpenAI endpoint in front of several ``pagedllm serve`` replicas (cache-aware), or of
prefill and decode instances (P/D disaggregation) (``pagedllm.entrypoints.router``; docs/kv-offload.md)."""

from __future__ import annotations

import argparse

from pagedllm.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "router", help="proxy in front of several `pagedllm serve` replicas (--backend, cache-aware) or of prefill "
                       "and decode instances (--prefill / --decode)",
        description="Replicas: `--backend URL --backend URL ...`, each request goes whole to one, chosen "
                    "cache-aware (the longest recorded prompt prefix within the load bound) or least loaded. "
                    "P/D disaggregation: `--prefill URL --decode URL` (each may repeat): the prompt runs on a "
                    "prefill instance chosen cache-aware, then the request on the least-loaded decode instance. "
                    "Cache-aware routing hashes the prompt's blocks: give --model (or --tokenizer) and the "
                    "backends' --block-size.")
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="base URL of a replica (repeat for each: http://10.0.0.1:8000)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="base URL of a kv_producer instance (repeat for several: http://127.0.0.1:8100)")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="base URL of a kv_consumer instance (repeat for several: http://127.0.0.1:8200)")
    p.add_argument("--routing", choices=("cache_aware", "least_loaded"), default="cache_aware",
                   help="how a replica (or prefill instance) is chosen (default cache_aware; decode instances are "
                        "always chosen by load)")
    p.add_argument("--model", default=None, help="the backends' model (local folder or Hub id): its tokenizer and "
                                                 "chat template give the token ids that routing hashes")
    p.add_argument("--tokenizer", default=None, help="tokenizer to use instead of --model's")
    p.add_argument("--block-size", type=int, default=16,
                   help="the backends' KV block size (their --block-size; default 16): the hashes must match theirs")
    p.add_argument("--kv-blocks", type=int, default=65536,
                   help="prefix blocks the router remembers per backend (about its KV pool; LRU beyond)")
    p.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="a prefix match loses to load when its backend has more than this many requests in flight "
                        "above the least loaded one ... (SGLang's name; default 32)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="... and more than this many times as many (default 1.5)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a backend call may take (then a 503)")
    p.add_argument("--connect-retries", type=int, default=5,
                   help="tries of another (or, with all down, the same) backend after a refused connection, "
                        "0.5 s apart when all refused")
    p.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between health checks of every backend (a backend down is back when it answers)")
    p.add_argument("--uvicorn-log-level", default="warning")
    p.set_defaults(func=run)


def load_tokenizer(name: str):
    """The tokenizer (with its chat template) that routing tokenizes prompts with; a clear error when it fails."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise UserError(f"--tokenizer/--model: cannot load a tokenizer from {name!r}: {e}") from None


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from pagedllm.engine.prefix_router import DPRoutingConfig
    from pagedllm.entrypoints.router import Router, build_app
    from pagedllm.errors import ParamError

    if args.backend and (args.prefill or args.decode):
        raise UserError("--backend: give either --backend (replicas) or --prefill and --decode (P/D), not both")
    if not args.backend and not (args.prefill and args.decode):
        raise UserError("--backend: give --backend URL (replicas), or both --prefill URL and --decode URL")
    if args.block_size < 1:
        raise UserError(f"--block-size: must be >= 1, got {args.block_size}")
    try:
        routing = DPRoutingConfig(args.routing, args.balance_abs_threshold, args.balance_rel_threshold)
    except ParamError as e:
        raise UserError(f"--{e.field.replace('dp_', '').replace('_', '-')}: {e.message}") from None
    name = args.tokenizer or args.model
    tokenizer = load_tokenizer(name) if name and args.routing == "cache_aware" else None
    router = Router(args.prefill, args.decode, args.timeout, args.connect_retries, backends=args.backend,
                    routing=routing, block_size=args.block_size, capacity_blocks=args.kv_blocks, tokenizer=tokenizer,
                    health_interval_s=args.health_interval)
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level=args.uvicorn_log_level)
