"""``pagedllm bench distributed``: one engine on N ranks x 1 thread against one rank x N threads, same host.

The two engines live in this process side by side and run the same greedy batch alternately (each repeat: one rank,
then the ranks), so a shared machine's noise hits both; the ratio is the median of per-repeat ratios. Reported per
engine step: wall time and, for the multi-rank engine, the time rank 0 spent waiting in collectives (all-reduce /
all-gather: transfer plus any skew between ranks). ``--executors mp,ray`` also times the Ray executor on the same
batch (after the mp engine is shut down: a process holds one torch.distributed world at a time, so that comparison
is sequential, not alternated).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class EngineRun:
    label: str
    elapsed_s: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    collective_s: list[float] = field(default_factory=list)
    collective_calls: list[int] = field(default_factory=list)

    def step_ms(self) -> float:
        return statistics.median(1e3 * e / s for e, s in zip(self.elapsed_s, self.steps))

    def collective_ms_per_step(self) -> Optional[float]:
        if not self.collective_s:
            return None
        return statistics.median(1e3 * c / s for c, s in zip(self.collective_s, self.steps))


@dataclass
class DistributedBenchResult:
    model: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_prompts: int
    input_len: int
    output_len: int
    repeats: int
    cpu: str
    runs: dict[str, dict] = field(default_factory=dict)
    output_tok_s: dict[str, float] = field(default_factory=dict)
    speedup_vs_one_rank: Optional[float] = None  # median of per-repeat (one-rank time / multi-rank time)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def _time_one(llm: Any, batch: list, sp: Any, run: EngineRun, executor: Any) -> None:
    engine = llm.llm_engine
    engine.kv.reset_prefix_cache()
    steps0 = engine.stats.num_steps
    comm = executor.par.tp_group if executor is not None and executor.par.tp_size > 1 else (
        executor.par.pp_group if executor is not None else None)
    c0, n0 = (comm.wait_s, comm.num_waits) if comm is not None else (0.0, 0)
    t = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    run.elapsed_s.append(time.perf_counter() - t)
    assert all(len(o.outputs[0].token_ids) == sp.max_tokens for o in outs)
    run.steps.append(engine.stats.num_steps - steps0)
    if comm is not None:
        run.collective_s.append(comm.wait_s - c0)
        run.collective_calls.append(comm.num_waits - n0)


def run(args) -> DistributedBenchResult:
    from pagedllm.bench.throughput import make_prompts  # heavy: torch, not at CLI start
    from pagedllm.commands.engine_args import engine_config  # heavy: torch, not at CLI start
    from pagedllm.entrypoints.llm import LLM  # heavy: torch, not at CLI start

    cfg = engine_config(args)
    world = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    if world < 2:
        raise SystemExit("pagedllm bench distributed: give --tensor-parallel-size or --pipeline-parallel-size > 1")
    all_cpus = os.sched_getaffinity(0)
    one = LLM(**vars(replace(cfg, tensor_parallel_size=1, pipeline_parallel_size=1)))
    prompts = make_prompts(args.num_prompts, args.input_len, one.llm_engine.model.vocab_size, 0, args.seed)
    batch = [{"prompt_token_ids": p} for p in prompts]
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
    res = DistributedBenchResult(one.llm_engine.model_path, cfg.tensor_parallel_size, cfg.pipeline_parallel_size,
                                 args.num_prompts, args.input_len, args.output_len, args.repeats, _cpu_model())
    threads = min(world, len(all_cpus))
    one_run = EngineRun(f"1 rank x {threads} threads")

    def as_one_rank() -> None:
        os.sched_setaffinity(0, all_cpus)
        torch.set_num_threads(threads)

    executors = [e.strip() for e in args.executors.split(",") if e.strip()]
    reference: Optional[list] = None
    for i, name in enumerate(executors):
        multi = LLM(**vars(replace(cfg, distributed_executor_backend=name)))
        ex = multi.llm_engine.executor
        multi_run = EngineRun(f"{name}: {world} ranks x {ex.driver.threads} thread(s)")
        as_one_rank()
        one.generate(batch[:4], sp.clone(max_tokens=2), use_tqdm=False)  # warm up both
        ex.rebind()
        outs = multi.generate(batch, sp.clone(max_tokens=4), use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        reference = reference or got
        assert got == reference, "greedy outputs differ between executors"
        for _ in range(args.repeats):
            if i == 0:  # the one-rank engine alternates with the first executor
                as_one_rank()
                _time_one(one, batch, sp, one_run, None)
            ex.rebind()
            _time_one(multi, batch, sp, multi_run, ex)
        multi.llm_engine.shutdown()
        res.runs[name] = asdict(multi_run) | {"step_ms": multi_run.step_ms(),
                                             "collective_ms_per_step": multi_run.collective_ms_per_step()}
        res.output_tok_s[name] = args.num_prompts * args.output_len / statistics.median(multi_run.elapsed_s)
        if i == 0:
            res.runs["one_rank"] = asdict(one_run) | {"step_ms": one_run.step_ms()}
            res.output_tok_s["one_rank"] = args.num_prompts * args.output_len / statistics.median(one_run.elapsed_s)
            res.speedup_vs_one_rank = statistics.median(a / b for a, b in zip(one_run.elapsed_s,
                                                                               multi_run.elapsed_s))
    as_one_rank()
    return res


def add_parser(sub) -> None:
    from pagedllm.commands.engine_args import add_engine_args  # heavy: torch, not at CLI start

    p = sub.add_parser("distributed", help="N ranks x 1 thread vs 1 rank x N threads (tensor/pipeline parallel)")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--executors", default="mp", help="comma list of executors to time: mp, ray")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.set_defaults(func=main)


def main(args) -> int:
    res = run(args)
    print(f"model={res.model} cpu={res.cpu} tp={res.tensor_parallel_size} pp={res.pipeline_parallel_size}")
    print(f"workload: {res.num_prompts} prompts x {res.input_len} -> {res.output_len} tokens, greedy, "
          f"{res.repeats} repeats")
    for name, r in res.runs.items():
        coll = r.get("collective_ms_per_step")
        print(f"{r['label']:>28}: {res.output_tok_s[name]:8.1f} output tok/s, {r['step_ms']:7.2f} ms/step"
              + (f", collectives {coll:6.2f} ms/step ({coll / r['step_ms']:.0%})" if coll is not None else "")
              + f"  (runs {', '.join(f'{t:.2f}s' for t in r['elapsed_s'])})")
    print(f"multi-rank ({next(iter(res.runs))}) vs one rank: {res.speedup_vs_one_rank:.3f}x "
          "(median of per-repeat time ratios, alternated)")
    if "mp" in res.runs and "ray" in res.runs:
        print(f"ray vs mp: {res.runs['ray']['step_ms'] - res.runs['mp']['step_ms']:+.2f} ms/step "
              "(sequential, not alternated)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(res), f, indent=2)
    return 0
