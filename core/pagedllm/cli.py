"""``pagedllm`` command line: each subcommand lives in its own module with ``add_parser(subparsers)``.

Errors reach the user as one line on stderr: a :class:`~pagedllm.errors.UserError` (bad flag value, unknown
device, missing or unsupported model, port in use, too little KV memory) exits 2 as argparse does, anything else
exits 1. ``--debug`` (any position) or ``PAGEDLLM_LOG_LEVEL=DEBUG`` prints the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import Optional, Sequence

from pagedllm.errors import UserError

COMMANDS = (
    "pagedllm.commands.generate",
    "pagedllm.commands.chat",
    "pagedllm.commands.backends",
    "pagedllm.commands.models",
    "pagedllm.commands.bench",
    "pagedllm.commands.serve",
    "pagedllm.conformance.cli",
)


def _add_debug(parser: argparse.ArgumentParser, top: bool) -> None:
    """``--debug`` on the top parser and on every subcommand, so it works wherever the user puts it."""
    parser.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="show the full traceback on errors (also PAGEDLLM_LOG_LEVEL=DEBUG)")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _add_debug(child, top=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="Paged-KV LLM inference and serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in COMMANDS:
        importlib.import_module(mod).add_parser(sub)
    _add_debug(parser, top=True)
    return parser


def _debug(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("PAGEDLLM_LOG_LEVEL", "").upper() == "DEBUG"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `pagedllm backends | head`: the reader left; exit quietly as coreutils do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 141
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as e:
        if _debug(args):
            traceback.print_exc()
        user = isinstance(e, UserError)
        text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())  # one line, always
        what = text if user else f"{type(e).__name__}: {text}"
        hint = "" if _debug(args) else " (--debug shows the traceback)"
        print(f"pagedllm {args.command}: error: {what}{'' if user else hint}", file=sys.stderr)
        return 2 if user else 1


if __name__ == "__main__":
    sys.exit(main())
