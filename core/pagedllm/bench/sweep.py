"""``pagedllm bench sweep``: ``bench serve`` over request rates (and ``--max-num-seqs`` values), as vLLM's sweep.

Against ``--base-url`` it sweeps request rates only; with ``--model`` it starts one ``pagedllm serve`` per
``--max-num-seqs`` value on a free loopback port (extra server flags in ``--serve-args``), sweeps the rates against
it and stops it. Every point is one ``bench serve`` run; results go to ``sweep.json`` and ``sweep.csv`` in
``--output-dir``, and ``--plot DIR`` draws them (bench/plots.py). Every row also names the run: ``device`` and
``dtype`` as the server was started, and the source ``commit``, which the charts print.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import subprocess
from dataclasses import asdict
from pathlib import Path

import pagedllm

from pagedllm.bench.serve import _event_loop_runner, run_async
from pagedllm.bench.server_process import ServeProcess
from pagedllm.errors import ParamError

CSV_FIELDS = ("max_num_seqs", "request_rate", "completed", "failed", "duration_s", "request_throughput",
              "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
              "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="bench serve over request rates / max_num_seqs, JSON + CSV, optional PNG charts")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--base-url", default=None, help="a running server (sweeps request rates only)")
    target.add_argument("--model", default=None, help="start `pagedllm serve MODEL` per --max-num-seqs value "
                                                      "(default: the embedded SmolLM2)")
    p.add_argument("--serve-args", default="", help="extra `pagedllm serve` flags, one string (e.g. '--device cpu')")
    p.add_argument("--request-rates", type=_rate, nargs="+", default=[1.0, 4.0, float("inf")], metavar="RATE",
                   help="requests/s (Poisson); inf = all at once (default: 1 4 inf)")
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=None, metavar="N",
                   help="server batch sizes to sweep (needs a started server: not with --base-url)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="the sweep's n-th point (from 0) draws its prompts with seed + n")
    p.add_argument("--output-dir", default=".", help="where sweep.json, sweep.csv (and server logs) go")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts here (needs matplotlib)")
    p.set_defaults(func=main)


def source_commit() -> str:
    """The git commit of the running code (``+dirty`` with local changes), else the package version."""
    here = str(Path(__file__).resolve().parent)
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"pagedllm {pagedllm.__version__}"


def run_settings(args) -> dict:
    """Device and dtype the servers run with (from ``--serve-args``; ``auto`` resolved as the server resolves it),
    and the commit. Against ``--base-url`` the server's own settings are not known here."""
    if args.base_url:
        return {"device": "unknown (--base-url)", "dtype": "unknown (--base-url)", "commit": source_commit()}
    serve = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    serve.add_argument("--device", default="auto")
    serve.add_argument("--dtype", default="auto")
    known, _ = serve.parse_known_args(shlex.split(args.serve_args))
    device = known.device
    if device == "auto":
        from pagedllm.backend import registry  # heavy: torch, the plugins

        device = registry.get_backend("auto").info.name
    return {"device": device, "dtype": known.dtype, "commit": source_commit()}


def _point(base_url: str, rate: float, args, index: int) -> dict:
    """One ``bench serve`` run. Point ``index`` of the sweep draws its own prompts (seed ``--seed + index``): a
    point reusing an earlier point's prompts on the same server would be served partly from its prefix cache, and
    by how much depends on the server's block size (pagedllm's 16-token blocks hit 7/8 of a 128-token prompt again,
    vLLM CPU's 128-token blocks none), not on its speed."""
    res = _event_loop_runner()(run_async(base_url, args.num_prompts, rate, args.input_len, args.output_len,
                                         seed=args.seed + index, keep_samples=True))
    return asdict(res)


def _summary(row: dict) -> str:
    return (f"max_num_seqs={row['max_num_seqs']} rate={row['request_rate']}: {row['completed']} ok, "
            f"{row['failed']} failed, {row['output_throughput']:.1f} out tok/s, TTFT p50/p99 "
            f"{row['median_ttft_ms']:.0f}/{row['p99_ttft_ms']:.0f} ms, TPOT p50/p99 "
            f"{row['median_tpot_ms']:.1f}/{row['p99_tpot_ms']:.1f} ms")


def write_results(rows: list[dict], out_dir: str) -> tuple[str, str]:
    """sweep.json (every field, per-request latencies included) and sweep.csv (the summary columns)."""
    os.makedirs(out_dir, exist_ok=True)
    json_path, csv_path = os.path.join(out_dir, "sweep.json"), os.path.join(out_dir, "sweep.csv")
    strict = [{k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in r.items()} for r in rows]
    with open(json_path, "w") as f:
        json.dump(strict, f, indent=1)
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(strict)
    return json_path, csv_path


def main(args) -> int:
    if args.base_url and args.max_num_seqs:
        raise ParamError("max_num_seqs", "sweeping --max-num-seqs starts its own servers: give --model, "
                                         "not --base-url")
    if args.num_prompts < 1:
        raise ParamError("num_prompts", f"must be >= 1, got {args.num_prompts}")
    if args.plot:
        from pagedllm.bench import plots  # fail on a missing matplotlib before the sweep, not after it

        plots.require_matplotlib()
    rows: list[dict] = []
    failed = 0
    settings = run_settings(args)
    for mns in ([None] if args.base_url else (args.max_num_seqs or [256])):
        server = None
        if args.base_url is None:
            log = os.path.join(args.output_dir, f"serve-max-num-seqs-{mns}.log")
            os.makedirs(args.output_dir, exist_ok=True)
            print(f"starting pagedllm serve (max_num_seqs={mns}, log {log}) ...", flush=True)
            server = ServeProcess(args.model, ["--max-num-seqs", str(mns), *shlex.split(args.serve_args)], log)
        try:
            for rate in args.request_rates:
                row = {"max_num_seqs": mns, **_point(args.base_url or server.base_url, rate, args, len(rows)),
                       **settings}
                failed += row["failed"]
                rows.append(row)
                print(_summary(row), flush=True)
        finally:
            if server is not None:
                server.stop()
    json_path, csv_path = write_results(rows, args.output_dir)
    print(f"wrote {json_path} and {csv_path}")
    if args.plot:
        for path in plots.plot_sweep(rows, args.plot):
            print(f"wrote {path}")
    return 0 if failed == 0 else 1
