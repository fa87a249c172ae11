"""``pagedllm`` command line: each subcommand lives in its own module with ``add_parser(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

COMMANDS = (
    "pagedllm.commands.generate",
    "pagedllm.commands.backends",
    "pagedllm.commands.bench",
    "pagedllm.commands.serve",
    "pagedllm.conformance.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="Paged-KV LLM inference and serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in COMMANDS:
        importlib.import_module(mod).add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from pagedllm.sampling_params import ParamError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ParamError as e:  # a bad flag value: one line naming it, argparse's exit code, no traceback
        print(f"pagedllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `pagedllm backends | head`: the reader left; exit quietly as coreutils do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 141


if __name__ == "__main__":
    sys.exit(main())
