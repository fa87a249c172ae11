"""``pagedllm conformance --device X [--report DIR] [--allow PAT ...] [--exclude PAT ...] [--tolerance K=ATOL,RTOL]``.

Exit status 0 when no case fails, 1 otherwise; the support matrix goes to stdout and, with --report, to files.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("conformance", help="check a backend's hooks against core's reference ops",
                       description="Run the partner conformance suite on one backend and print its support matrix.")
    p.add_argument("--device", required=True, help="backend name (see `pagedllm backends`)")
    p.add_argument("--report", metavar="DIR", help="write conformance-<device>.{md,json,csv} here")
    p.add_argument("--allow", nargs="+", action="extend", default=[], metavar="PATTERN",
                   help="run only cases matching a pattern (case id kernel[model|dtype], kernel or feature; * ?)")
    p.add_argument("--exclude", nargs="+", action="extend", default=[], metavar="PATTERN",
                   help="report matching cases as untested")
    p.add_argument("--tolerance", action="append", default=[], metavar="KEY=ATOL,RTOL",
                   help="override tolerances for a dtype or a case pattern, e.g. bfloat16=5e-2,5e-2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-q", "--quiet", action="store_true", help="no per-case progress")
    p.set_defaults(func=run)
    return p


def parse_tolerances(items: list[str]) -> dict[str, tuple[float, float]]:
    out = {}
    for item in items:
        key, _, val = item.rpartition("=")
        atol, _, rtol = val.partition(",")
        if not key or not atol:
            raise SystemExit(f"--tolerance {item!r}: expected KEY=ATOL,RTOL")
        out[key] = (float(atol), float(rtol or atol))
    return out


def run(args: argparse.Namespace) -> int:
    from pagedllm.backends import BackendError
    from pagedllm.conformance import run_conformance

    def progress(r) -> None:
        if not args.quiet and r.status != "untested":
            mark = "ok  " if r.status == "passing" else "FAIL"
            print(f"{mark} {r.id} ({r.seconds:.2f}s){'  ' + r.error if r.error else ''}", file=sys.stderr)

    try:
        report = run_conformance(args.device, report_dir=args.report, allow=args.allow, exclude=args.exclude,
                                 tolerances=parse_tolerances(args.tolerance), seed=args.seed, progress=progress)
    except BackendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.to_markdown())
    if args.report:
        print(f"report written to {args.report}/conformance-{report.backend}.{{md,json,csv}}")
    return 0 if report.passed else 1
