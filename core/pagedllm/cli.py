"""``pagedllm`` command line: each subcommand lives in its own module with ``add_parser(subparsers)``.

Errors reach the user as one line on stderr: a :class:`~pagedllm.errors.UserError` (bad flag value, unknown
device, missing or unsupported model, port in use, too little KV memory) exits 2 as argparse does, anything else
exits 1. ``--debug`` (any position) or ``PAGEDLLM_LOG_LEVEL=DEBUG`` prints the traceback instead. Argparse's own
errors are one line too (no usage dump), a mistyped flag or command names the closest valid one, and flags are
never abbreviated (``--model`` must not be read as ``--model-impl``).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
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
    "pagedllm.commands.router",
    "pagedllm.conformance.cli",
)


class Parser(argparse.ArgumentParser):
    """Every ``pagedllm`` parser: no prefix matching, and errors as one line that says what to do next."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = [c.strip(" '") for c in choice.group(2).split(",")]
            subs = [a.dest for a in self._actions if isinstance(a, argparse._SubParsersAction)]
            what = "unknown command" if any(message.startswith(f"argument {d}:") for d in subs) else \
                message[:choice.start()] + "invalid choice"
            message = f"{what} {choice.group(1)!r}" + _did_you_mean(choice.group(1), options,
                                                                  f" (choose from {', '.join(options)})")
        if not message.endswith("?"):
            message += f"; `{self.prog} --help` lists the options"
        self.exit(2, f"{self.prog}: error: {message}\n")


def _did_you_mean(word: str, candidates: Sequence[str], otherwise: str = "") -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else otherwise


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command the user ran (``pagedllm bench sweep`` -> the sweep parser)."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, sub.dest, None) if sub is not None else None
        if name is None or name not in sub.choices:
            return parser
        parser = sub.choices[name]


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    chosen = _chosen_parser(parser, args)
    flags = [f for f in extras if f.startswith("-")]
    if not flags:
        chosen.error(f"unexpected argument {extras[0]!r}")
    flag = flags[0].split("=", 1)[0]
    valid = [o for a in chosen._actions for o in a.option_strings if o.startswith("--")]
    chosen.error(f"unrecognized argument {flag}" + _did_you_mean(flag, valid))


def _add_debug(parser: argparse.ArgumentParser, top: bool) -> None:
    """``--debug`` on the top parser and on every subcommand, so it works wherever the user puts it."""
    parser.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="show the full traceback on errors (also PAGEDLLM_LOG_LEVEL=DEBUG)")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _add_debug(child, top=False)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pagedllm", description="Paged-KV LLM inference and serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in COMMANDS:
        importlib.import_module(mod).add_parser(sub)
    _add_debug(parser, top=True)
    return parser


def _debug(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("PAGEDLLM_LOG_LEVEL", "").upper() == "DEBUG"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unrecognized(parser, args, extras)
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
