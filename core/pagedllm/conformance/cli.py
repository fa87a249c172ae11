"""``pagedllm conformance --device X [--report DIR] [--allow PAT ...] [--exclude PAT ...] [--tolerance K=ATOL,RTOL]
[--simulated DESCRIPTION]``, and ``pagedllm conformance --support-matrix OUT.md --from-reports A.json ...``.

Exit status 0 when no case fails (PASS or PARTIAL; the summary line says which), 1 when one does; the backend's
matrix goes to stdout and, with --report, to files. ``--support-matrix`` writes the project's backend x feature
table from saved JSON reports (with --device too: this run's report is included).
"""

from __future__ import annotations

import argparse
import sys

from pagedllm.backend import registry
from pagedllm.conformance import run_conformance
from pagedllm.conformance.matrix import load_reports, support_matrix


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("conformance", help="check a backend's hooks against core's reference ops",
                       description="Run the partner conformance suite on one backend and print its support matrix.")
    p.add_argument("--device", help="backend name (see `pagedllm backends`)")
    p.add_argument("--report", metavar="DIR", help="write conformance-<device>.{md,json,csv} here")
    p.add_argument("--allow", nargs="+", action="extend", default=[], metavar="PATTERN",
                   help="run only cases matching a pattern (case id kernel[model|dtype], kernel or feature; * ?)")
    p.add_argument("--exclude", nargs="+", action="extend", default=[], metavar="PATTERN",
                   help="report matching cases as untested")
    p.add_argument("--tolerance", action="append", default=[], metavar="KEY=ATOL,RTOL",
                   help="override tolerances for a dtype or a case pattern, e.g. bfloat16=5e-2,5e-2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulated", metavar="DESCRIPTION", default=None,
                   help="the backend runs on a simulated device layer (say which): the report is "
                        "verified-on-CPU-simulation, never on hardware (default: $PAGEDLLM_CONFORMANCE_SIMULATED)")
    p.add_argument("--support-matrix", metavar="OUT.md",
                   help="write the backend x feature support matrix (e.g. docs/support-matrix.md)")
    p.add_argument("--from-reports", nargs="+", action="extend", default=[], metavar="JSON",
                   help="conformance-<backend>.json reports for --support-matrix")
    p.add_argument("--backends", nargs="+", action="extend", default=None, metavar="NAME",
                   help="backends listed in --support-matrix even without a report (default: every installed one)")
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


def write_matrix(args: argparse.Namespace, extra: list) -> None:
    reports = load_reports(args.from_reports) + extra
    if args.backends is None:
        names = [n for n in registry.discover() if not n.startswith("<")]
    else:
        names = args.backends
    with open(args.support_matrix, "w") as f:
        f.write(support_matrix(reports, names))
    print(f"support matrix written to {args.support_matrix} ({len(reports)} report(s))", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if not args.device:
        if not args.support_matrix:
            print("error: give --device NAME, or --support-matrix OUT.md --from-reports JSON ...", file=sys.stderr)
            return 2
        write_matrix(args, [])
        return 0

    def progress(r) -> None:
        if not args.quiet and r.status != "untested":
            mark = "ok  " if r.status == "passing" else "FAIL"
            print(f"{mark} {r.id} ({r.seconds:.2f}s){'  ' + r.error if r.error else ''}", file=sys.stderr)

    try:
        report = run_conformance(args.device, report_dir=args.report, allow=args.allow, exclude=args.exclude,
                                 tolerances=parse_tolerances(args.tolerance), seed=args.seed, progress=progress,
                                 simulated=args.simulated)
    except registry.BackendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.to_markdown())
    if args.report:
        print(f"report written to {args.report}/conformance-{report.backend}.{{md,json,csv}}")
    if args.support_matrix:
        write_matrix(args, [report])
    return 0 if report.passed else 1
