"""``pagedllm bench <name> ...``: every benchmark of the project, one module of ``pagedllm.bench`` each."""

from __future__ import annotations

import argparse
import importlib
import os
from typing import Callable

from pagedllm.backend.builds import WAIT_ENV, running
from pagedllm.errors import UserError

BENCHES = ("pagedllm.bench.throughput", "pagedllm.bench.serve", "pagedllm.bench.sweep", "pagedllm.bench.moe",
           "pagedllm.bench.latency", "pagedllm.bench.scale_model", "pagedllm.bench.distributed",
           "pagedllm.bench.quant_linear", "pagedllm.bench.perplexity", "pagedllm.bench.serve_vs_offline",
           "pagedllm.bench.dp_ep", "pagedllm.bench.quant", "pagedllm.bench.quant_alternated",
           "pagedllm.bench.llama_cpp", "pagedllm.bench.llama_cpp_parity", "pagedllm.bench.llama_cpp_perplexity",
           "pagedllm.bench.graph", "pagedllm.bench.prefix_routing", "pagedllm.bench.router_routing",
           "pagedllm.bench.kv_offload", "pagedllm.bench.random_model", "pagedllm.bench.kv_memory", "pagedllm.bench.pd",
           "pagedllm.bench.mm_throughput", "pagedllm.bench.paged_attention")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    for mod in BENCHES:
        importlib.import_module(mod).add_parser(bsub)
    for sp in bsub.choices.values():
        sp.set_defaults(func=_no_figures_while_building(sp.get_default("func")))


def _no_figures_while_building(func: Callable[[argparse.Namespace], object]) -> Callable[[argparse.Namespace], object]:
    """A figure taken while a plugin compiles its ops on the same cores measures the build and the fallback path
    (a tenth of the real speed was seen): refuse while another build runs, and make this run's engines (and the
    servers or peers it starts) wait for their own build instead of starting it in the background."""

    def run(args: argparse.Namespace) -> object:
        busy = running()
        if busy:
            raise UserError(f"a build of compiled ops is running on this machine ({', '.join(busy)}); figures taken "
                            "now would measure the build and the fallback path. Run the benchmark when it ends.")
        os.environ[WAIT_ENV] = "1"
        return func(args)

    return run
