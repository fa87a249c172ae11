"""``python -m pagedllm.conformance --device X [--report DIR] ...``: the same as ``pagedllm conformance``."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from pagedllm.conformance.cli import add_parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.conformance")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["conformance", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
