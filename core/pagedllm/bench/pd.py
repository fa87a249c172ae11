"""``pagedllm bench pd``: prefill/decode disaggregation against one colocated instance under a mixed load
(docs/kv-offload.md, issue 31).

Two setups, as real processes on 127.0.0.1: (a) one colocated ``pagedllm serve`` whose engine gets every CPU, and
(b) a prefill instance (``kv_producer``) and a decode instance (``kv_consumer``) sharing a ``LoopbackConnector``
folder, each engine on half the CPUs (``--engine-cpus``: one torch thread per CPU, ``OMP_NUM_THREADS`` to match),
with ``pagedllm router`` in front. Every round starts each setup alone (their order swapped every round), drives the
same seeded load against it and stops it: ``--decode-streams`` streaming short-prompt, long-output requests (the
streams whose inter-token latency P/D exists for) while ``--num-long`` long prompts arrive as a Poisson process at
``--long-rate``. Reported per setup, medians over rounds: ITL p50 / p99 and TTFT p50 / p99 of the decode streams,
TTFT p50 / p99 of the long prompts, output tokens/s; and colocated / P/D, the median of per-round ratios.

Every process is started and stopped from Python with a timeout (a server that does not come up is stopped and its
log's tail raised; servers are always stopped in ``finally``); every request has a timeout, and so has the whole load.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from pagedllm.bench.server_process import PAGEDLLM, ServeProcess

SETUPS = ("colocated", "pd")
SERVE_DEFAULT = "--device cpu --max-model-len 2048"
#: The ISA flags worth quoting with a CPU figure (lscpu's are hundreds).
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "asimd", "sve", "neon")
#: Keys of one setup's result whose per-round medians (and colocated / P/D ratios) are reported.
FIELDS = ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "long_ttft_p50_ms", "long_ttft_p99_ms",
          "output_tok_s")


def add_parser(sub) -> None:
    p = sub.add_parser("pd", help="prefill/decode disaggregation (prefill + decode instance + router) vs one "
                                  "colocated instance under a mixed long-prompt / streaming-decode load, per round")
    p.add_argument("--model", default=None, help="model to serve (default: `pagedllm serve`'s, the embedded SmolLM2)")
    p.add_argument("--serve-args", default=SERVE_DEFAULT,
                   help=f"more `pagedllm serve` flags for every instance, one string (default {SERVE_DEFAULT!r})")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-streams", type=int, default=8,
                   help="concurrent streaming short-prompt requests (the ITL that counts)")
    p.add_argument("--num-decode", type=int, default=16, help="short-prompt requests in all, --decode-streams at once")
    p.add_argument("--decode-input-len", type=int, default=32)
    p.add_argument("--decode-output-len", type=int, default=128)
    p.add_argument("--num-long", type=int, default=8, help="long prompts in all")
    p.add_argument("--long-len", type=int, default=1500, help="tokens of each long prompt")
    p.add_argument("--long-output-len", type=int, default=4)
    p.add_argument("--long-rate", type=float, default=0.5, help="long prompts per second (Poisson arrivals)")
    p.add_argument("--cpus", default=None, metavar="LIST",
                   help="CPUs to use (taskset syntax; default: every CPU this process may use): the colocated "
                        "engine gets all, the prefill engine the first half, the decode engine the second half")
    p.add_argument("--seed", type=int, default=0, help="round r uses seed + r (both setups the same)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--load-timeout", type=float, default=1800.0, help="seconds one setup's whole load may take")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to come up")
    p.add_argument("--json", default=None, help="write every round's results and the summary as JSON here")
    p.set_defaults(func=main)


# ---- what the figure ran on ------------------------------------------------------------------------------------------
def cpu_kind() -> tuple[str, list[str]]:
    """lscpu's model name and the ISA flags among its flags (``/proc/cpuinfo`` where lscpu is missing)."""
    fields: dict[str, str] = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines())}
    except (OSError, subprocess.SubprocessError):
        pass
    if "model name" not in fields:
        try:
            with open("/proc/cpuinfo") as f:
                for ln in f:
                    k, _, v = ln.partition(":")
                    fields.setdefault(k.strip().lower().replace("features", "flags"), v.strip())
        except OSError:
            pass
    flags = sorted(f for f in fields.get("flags", "").split() if f.startswith(ISA_PREFIXES))
    return fields.get("model name", "unknown"), flags


def cpu_split(text: Optional[str]) -> tuple[list[int], list[int], list[int]]:
    """(colocated, prefill, decode) engine CPUs."""
    if text:
        from pagedllm.engine.cpu_split import parse_cpu_list  # heavy: torch, not at CLI start

        cpus = sorted(parse_cpu_list(text, "cpus"))
    else:
        cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"pagedllm bench pd: needs at least 2 CPUs (one each for prefill and decode), got {cpus}")
    half = len(cpus) // 2
    return cpus, cpus[:half], cpus[half:]


def cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(map(str, cpus))


# ---- processes ------------------------------------------------------------------------------------------------------
def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class RouterProcess:
    """``pagedllm router`` on a free loopback port; ready on return, or stopped and a ``RuntimeError``."""

    def __init__(self, prefill: str, decode: str, log_path: str, timeout: float, request_timeout: float):
        from pagedllm.executor.base import free_port  # heavy: torch, not at CLI start

        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([*PAGEDLLM, "router", "--prefill", prefill, "--decode", decode, "--port",
                                      str(port), "--timeout", str(request_timeout)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not _healthy(self.base_url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                with open(log_path, errors="replace") as f:
                    raise RuntimeError(f"`pagedllm router` did not come up (log {log_path}):\n{f.read()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _serve(args, name: str, cpus: Sequence[int], extra: Sequence[str], logs: list[str]) -> ServeProcess:
    fd, log = tempfile.mkstemp(prefix=f"bench-pd-{name}-", suffix=".log")
    os.close(fd)
    logs.append(log)
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus))}
    return ServeProcess(args.model, ["--served-model-name", "m", "--engine-cpus", cpu_list(cpus), *extra,
                                     *shlex.split(args.serve_args)], log, timeout=args.start_timeout, env=env)


def _counters(url: str) -> dict[str, float]:
    """A server's /metrics, summed over label sets (name -> value)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


# ---- the load -------------------------------------------------------------------------------------------------------
def make_load(args, seed: int) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """(decode prompts, long prompts, long arrival gaps): the same for both setups of a round."""
    from pagedllm.bench.serve import arrival_gaps, make_prompts

    decode = make_prompts(args.num_decode, args.decode_input_len, 100, 30000, seed)
    long = make_prompts(args.num_long, args.long_len, 100, 30000, seed + 1000)
    return decode, long, arrival_gaps(args.num_long, args.long_rate, seed)


async def _drive(base: str, args, seed: int) -> dict:
    import aiohttp  # optional: aiohttp (pagedllm[serve])
    import numpy as np

    from pagedllm.bench.serve import _one

    decode, long, gaps = make_load(args, seed)
    url = f"{base}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                     read_bufsize=1 << 20) as s:
        warm = make_load(args, seed + 7919)  # other tokens: no prefix-cache hit on the measured prompts
        for prompt, n in ((warm[0][0], 4), *(((warm[1][0], 2),) if warm[1] else ())):
            w = await _one(s, url, {}, "m", prompt, n)
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        sem = asyncio.Semaphore(args.decode_streams)

        async def stream(p: list[int]):
            async with sem:
                return await _one(s, url, {}, "m", p, args.decode_output_len)

        async def longs():
            tasks = []
            for p, gap in zip(long, gaps):
                await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(_one(s, url, {}, "m", p, args.long_output_len)))
            return await asyncio.gather(*tasks)

        t0 = time.perf_counter()
        dec, lng = await asyncio.gather(asyncio.gather(*(stream(p) for p in decode)), longs())
        duration = time.perf_counter() - t0

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(np.asarray(values) * 1000.0, q)) if values else float("nan")

    ok_d, ok_l = [r for r in dec if r.ok], [r for r in lng if r.ok]
    itl = [x for r in ok_d for x in r.itl]
    errors = sorted({r.error for r in (*dec, *lng) if not r.ok})
    return {"duration_s": duration, "failed": len(dec) + len(lng) - len(ok_d) - len(ok_l), "errors": errors[:5],
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "ttft_p50_ms": pct([r.ttft for r in ok_d], 50), "ttft_p99_ms": pct([r.ttft for r in ok_d], 99),
            "long_ttft_p50_ms": pct([r.ttft for r in ok_l], 50), "long_ttft_p99_ms": pct([r.ttft for r in ok_l], 99),
            "output_tokens": sum(r.output_tokens for r in (*ok_d, *ok_l)),
            "output_tok_s": sum(r.output_tokens for r in (*ok_d, *ok_l)) / duration}


def drive(base: str, args, seed: int) -> dict:
    async def bounded():
        return await asyncio.wait_for(_drive(base, args, seed), args.load_timeout)

    return asyncio.run(bounded())


# ---- one setup, one round -------------------------------------------------------------------------------------------
def run_setup(args, setup: str, seed: int, split: tuple[list[int], list[int], list[int]]) -> dict:
    """Start ``setup`` alone, run the round's load against it, stop it (always)."""
    both, pcpus, dcpus = split
    logs: list[str] = []
    procs: list = []
    store = None
    try:
        if setup == "colocated":
            procs.append(_serve(args, "colocated", both, [], logs))
            result = drive(procs[0].base_url, args, seed)
        else:
            store = tempfile.mkdtemp(prefix="bench-pd-kv-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            cfg = {"kv_connector": "LoopbackConnector",
                   "kv_connector_extra_config": {"shared_storage_path": store}}
            with ThreadPoolExecutor(2) as pool:  # both load at once: start-up is most of a small run's time
                futures = [pool.submit(_serve, args, name, cpus,
                                       ["--kv-transfer-config", json.dumps({**cfg, "kv_role": role})], logs)
                           for name, role, cpus in (("prefill", "kv_producer", pcpus),
                                                    ("decode", "kv_consumer", dcpus))]
            procs.extend(f.result() for f in futures if f.exception() is None)
            for f in futures:
                if f.exception() is not None:
                    raise f.exception()
            fd, log = tempfile.mkstemp(prefix="bench-pd-router-", suffix=".log")
            os.close(fd)
            logs.append(log)
            procs.append(RouterProcess(procs[0].base_url, procs[1].base_url, log, args.start_timeout,
                                       args.request_timeout))
            before = _counters(procs[1].base_url)
            result = drive(procs[2].base_url, args, seed)
            after = _counters(procs[1].base_url)
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in
                     ("pagedllm:kv_offload_hits_total", "pagedllm:kv_offload_load_errors_total",
                      "pagedllm:prompt_tokens_total")}
            result.update(decode_loaded_blocks=int(delta["pagedllm:kv_offload_hits_total"]),
                          decode_load_errors=int(delta["pagedllm:kv_offload_load_errors_total"]),
                          decode_prompt_tokens=int(delta["pagedllm:prompt_tokens_total"]))
    finally:
        for p in reversed(procs):
            p.stop()
        if store:
            shutil.rmtree(store, ignore_errors=True)
    for log in logs:
        os.unlink(log)
    return result


# ---- the report -----------------------------------------------------------------------------------------------------
def summarize(runs: dict[str, list[dict]]) -> dict:
    med = {s: {f: statistics.median(r[f] for r in runs[s]) for f in FIELDS} for s in SETUPS}
    ratio = {}
    for f in FIELDS:
        pairs = [(c[f], p[f]) for c, p in zip(runs["colocated"], runs["pd"]) if p[f] and c[f] == c[f] and p[f] == p[f]]
        ratio[f] = statistics.median(c / p for c, p in pairs) if pairs else float("nan")
    return {"median": med, "colocated_over_pd": ratio}


def main(args) -> int:
    if args.rounds < 1 or args.decode_streams < 1 or args.num_decode < 1 or args.num_long < 0:
        raise SystemExit("pagedllm bench pd: --rounds, --decode-streams and --num-decode must be >= 1")
    if not args.long_rate > 0:
        raise SystemExit(f"pagedllm bench pd: --long-rate must be > 0 (inf: all at once), got {args.long_rate}")
    split = cpu_split(args.cpus)
    model, flags = cpu_kind()
    both, pcpus, dcpus = split
    threads = (f"colocated engine on CPUs {cpu_list(both)} ({len(both)} torch threads); prefill engine on CPUs "
               f"{cpu_list(pcpus)} ({len(pcpus)}), decode engine on CPUs {cpu_list(dcpus)} ({len(dcpus)}) "
               "(--engine-cpus and OMP_NUM_THREADS); HTTP processes, the router and this load client unpinned")
    print(f"CPU: {model}; ISA flags: {' '.join(flags) or 'none'}")
    print(f"threads: {threads}")
    print(f"load: {args.num_decode} streams of {args.decode_input_len} -> {args.decode_output_len} tokens, "
          f"{args.decode_streams} at once, beside {args.num_long} prompts of {args.long_len} -> {args.long_output_len} "
          f"tokens at {args.long_rate}/s (Poisson); {args.rounds} rounds, setups alternated", flush=True)
    runs: dict[str, list[dict]] = {s: [] for s in SETUPS}
    for i in range(args.rounds):
        for setup in (SETUPS if i % 2 == 0 else SETUPS[::-1]):
            runs[setup].append(run_setup(args, setup, args.seed + i, split))
            r = runs[setup][-1]
            print(f"round {i + 1} {setup:9s} " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()
                                                            if isinstance(v, float)), flush=True)
    summary = summarize(runs)
    print(f"\nmedians of {args.rounds} rounds (ms; decode = the {args.decode_streams} streaming requests)")
    print(f"{'setup':10s} {'ITL p50':>9s} {'ITL p99':>9s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'long TTFT p50':>14s} "
          f"{'long p99':>9s} {'out tok/s':>10s} failed")
    for s in SETUPS:
        m = summary["median"][s]
        print(f"{s:10s} {m['itl_p50_ms']:9.1f} {m['itl_p99_ms']:9.1f} {m['ttft_p50_ms']:9.1f} {m['ttft_p99_ms']:9.1f} "
              f"{m['long_ttft_p50_ms']:14.1f} {m['long_ttft_p99_ms']:9.1f} {m['output_tok_s']:10.1f} "
              f"{sum(r['failed'] for r in runs[s])}")
    rt = summary["colocated_over_pd"]
    print("colocated / P/D (median of per-round ratios; > 1: P/D lower latency or, for tok/s, colocated faster): "
          + ", ".join(f"{f} {rt[f]:.2f}" for f in FIELDS))
    loaded = [r["decode_loaded_blocks"] for r in runs["pd"]]
    print(f"decode instance: blocks loaded from the prefill instance per round {loaded}, load errors "
          f"{[r['decode_load_errors'] for r in runs['pd']]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": model, "cpu_flags": flags, "threads": threads,
                       "cpus": {"colocated": both, "prefill": pcpus, "decode": dcpus},
                       "load": {k: getattr(args, k) for k in ("decode_streams", "num_decode", "decode_input_len",
                                                              "decode_output_len", "num_long", "long_len",
                                                              "long_output_len", "long_rate", "rounds", "seed")},
                       "model": args.model, "serve_args": args.serve_args, "rounds": runs, **summary}, f, indent=1)
    return 0 if all(r["failed"] == 0 for s in SETUPS for r in runs[s]) else 1
