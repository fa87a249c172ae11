"""``pagedllm models``: the supported-model table (native decoders, the transformers fallback, GGUF)."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list supported model architectures and which path runs them")
    p.add_argument("--json", action="store_true", help="rows plus every fallback architecture, as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm.models.support import fallback_architectures, markdown_table, rows  # heavy: pagedllm.models

    if args.json:
        print(json.dumps({"models": rows(), "fallback_architectures": fallback_architectures()}, indent=2))
    else:
        print(markdown_table(), end="")
    return 0
