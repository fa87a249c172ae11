"""``pagedllm bench <name> ...``: every benchmark of the project, one module of ``pagedllm.bench`` each."""

from __future__ import annotations

import importlib

BENCHES = ("pagedllm.bench.throughput", "pagedllm.bench.serve", "pagedllm.bench.sweep", "pagedllm.bench.moe",
           "pagedllm.bench.latency", "pagedllm.bench.scale_model", "pagedllm.bench.distributed",
           "pagedllm.bench.quant_linear", "pagedllm.bench.perplexity", "pagedllm.bench.serve_vs_offline",
           "pagedllm.bench.dp_ep", "pagedllm.bench.quant", "pagedllm.bench.quant_alternated",
           "pagedllm.bench.llama_cpp", "pagedllm.bench.graph")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    for mod in BENCHES:
        importlib.import_module(mod).add_parser(bsub)
