"""``pagedllm bench dp-ep``: DP+EP against plain data parallel and one engine, alternated (docs/distributed.md,
issue 14).

Every round starts each server alone, records its engine processes' resident memory, drives it with
``pagedllm bench serve`` and stops it (SIGTERM: a DP+EP replica then logs its lock-step forwards and the time it spent
in MoE exchanges, parsed here). Ratios are medians of per-round ratios, so load from other processes hits every
configuration alike.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

from pagedllm.bench.server_process import ServeProcess, bench_serve
from pagedllm.errors import UserError

CONFIGS = {"dp1": ["--engine-cpus", "0-1"], "dp2": ["--data-parallel-size", "2"],
           "dp2_ep": ["--data-parallel-size", "2", "--enable-expert-parallel"]}
SERVE_ARGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--served-model-name", "m"]
EXCHANGE = re.compile(r"DP\+EP replica (\d+): (\d+) lock-step forwards \((\d+) dummy\).*?([\d.]+) ms per forward")


def add_parser(sub) -> None:
    p = sub.add_parser("dp-ep", help="DP+EP vs DP=2 vs one engine on an MoE model: servers alternated per round")
    p.add_argument("--model", default=None, help="an MoE model folder with a tokenizer (default: build the bench "
                                                 "Mixtral of tests/support/tiny_models.py into a temporary folder)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)


def descendants_rss_mb(pid: int) -> list[float]:
    """Resident memory of every descendant of ``pid``, largest first (the engine processes lead)."""
    out: list[float] = []
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for k in kids:
        try:
            out.append(int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{k}/status").read_text()).group(1)) / 1024)
        except (OSError, AttributeError):
            pass
        out += descendants_rss_mb(int(k))
    return sorted(out, reverse=True)


def run_one(model: str, name: str, bench: list[str]) -> dict:
    """Start the ``name`` server alone, measure it, stop it; the replicas' exchange summary comes from its log."""

    fd, log = tempfile.mkstemp(prefix=f"bench-dp-ep-{name}-", suffix=".log")
    os.close(fd)
    server = ServeProcess(model, [*SERVE_ARGS, *CONFIGS[name]], log, timeout=300)
    try:
        rss = descendants_rss_mb(server.proc.pid)[: 1 if name == "dp1" else 2]
        r = bench_serve(server.base_url, bench, log + ".json")
    finally:
        server.stop()
    text = server.log_text()
    os.unlink(log)
    return dict(tok_s=r["output_throughput"], ttft_ms=r["median_ttft_ms"], tpot_ms=r["median_tpot_ms"],
                failed=r["failed"], rss_mb=[round(x) for x in rss],
                exchange_ms_per_forward=[float(m[3]) for m in EXCHANGE.findall(text)])


def main(args) -> int:
    if args.model is not None:
        return run(args, args.model)
    tests = Path(__file__).resolve().parents[3] / "tests" / "support"  # a source checkout's test helpers
    if not (tests / "tiny_models.py").exists():
        raise UserError(f"no {tests}/tiny_models.py to build the bench Mixtral from: give --model")
    sys.path.insert(0, str(tests))
    from server_utils import tiny_chat_model  # test helpers: on sys.path only from here
    from tiny_models import make_bench_mixtral  # test helpers: on sys.path only from here

    with tempfile.TemporaryDirectory(prefix="bench-mixtral-") as d:
        return run(args, make_bench_mixtral(d, tiny_chat_model()))


def run(args, model: str) -> int:
    bench = ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
             str(args.output_len)]
    runs: dict[str, list[dict]] = {k: [] for k in CONFIGS}
    for r in range(args.rounds):
        for name in CONFIGS:
            runs[name].append(run_one(model, name, bench))
            print(r, name, runs[name][-1], flush=True)
    med = lambda k, f: statistics.median(x[f] for x in runs[k])  # noqa: E731
    for k in CONFIGS:
        print(f"{k:7s} median output tok/s {med(k, 'tok_s'):7.1f}  TTFT {med(k, 'ttft_ms'):6.0f} ms  "
              f"TPOT {med(k, 'tpot_ms'):6.1f} ms  engine RSS MiB {[x['rss_mb'] for x in runs[k]]}")
    for other in ("dp2", "dp1"):
        ratio = statistics.median(e["tok_s"] / o["tok_s"] for e, o in zip(runs["dp2_ep"], runs[other]))
        print(f"DP+EP / {other} output tok/s, median of per-round ratios: {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0
