"""``pagedllm bench quant-alternated``: the embedded SmolLM2 GGUF as float32 dense, bfloat16 dense and Q4_1 packed,
alternated in one process (docs/benchmarks.md, issue 12).

For a shared, noisy machine: every round times each configuration back to back, and the ratios are medians of
per-round ratios, so load from other processes hits all configurations alike. Absolute numbers on an idle machine:
``pagedllm bench quant`` (``bench throughput``, one process per configuration).
"""

from __future__ import annotations

import statistics
import time

from pagedllm.proc_mem import rss_bytes

#: --configs name -> LLM keyword arguments
KNOWN = {"fp32": dict(quantization="none"), "bf16": dict(dtype="bfloat16"), "q4_1": {},
         "q4_1_bf16": dict(quantization="gguf", dtype="bfloat16")}  # packed weights, bf16 activations


def add_parser(sub) -> None:
    p = sub.add_parser("quant-alternated", help="embedded SmolLM2: fp32 / bf16 / Q4_1 engines alternated in one "
                                                "process (batch-1 decode, batch throughput, RSS)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batch-tokens", type=int, default=16)
    p.add_argument("--configs", default="fp32,bf16,q4_1", help=f"comma-separated, of {','.join(KNOWN)}")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with the process's CPU time instead of wall time: on a machine other work is slowing, "
                        "run with OMP_NUM_THREADS=1 and compare single-thread CPU cost")
    p.set_defaults(func=main)


def own_rss_mb() -> float:
    return (rss_bytes() or 0) / (1 << 20)


def main(args) -> int:
    clock = time.process_time if args.cpu_time else time.perf_counter
    from pagedllm import LLM, SamplingParams  # heavy: torch, not at CLI start

    configs = {n: KNOWN[n] for n in args.configs.split(",")}
    engines, added = {}, {}
    for name, kw in configs.items():
        before = own_rss_mb()
        engines[name] = LLM(None, device="cpu", max_model_len=512, kv_cache_memory=64 << 20, **kw)
        added[name] = own_rss_mb() - before
        print(f"{name}: quantization={engines[name].llm_engine.config.quantization} init "
              f"{engines[name].llm_engine.init_seconds:.1f} s, RSS added {added[name]:.0f} MB", flush=True)
    prompt = [{"prompt_token_ids": list(range(1000, 1016))}]
    batch = [{"prompt_token_ids": list(range(1000 + 20 * i, 1032 + 20 * i))} for i in range(args.batch)]
    sp1 = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.decode_tokens)
    spb = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.batch_tokens)
    for llm in engines.values():  # warm up
        llm.generate(prompt, sp1.clone(max_tokens=4), use_tqdm=False)
    rates: dict[str, dict[str, list[float]]] = {"b1": {n: [] for n in configs}, "batch": {n: [] for n in configs}}
    for r in range(args.rounds):
        for name, llm in engines.items():
            llm.generate(prompt, sp1.clone(max_tokens=1), use_tqdm=False)
            t = clock()
            llm.generate(prompt, sp1, use_tqdm=False)
            rates["b1"][name].append(args.decode_tokens / (clock() - t))
            t = clock()
            llm.generate(batch, spb, use_tqdm=False)
            rates["batch"][name].append(args.batch * args.batch_tokens / (clock() - t))
        print(f"round {r + 1}: " + ", ".join(f"{n} b1 {rates['b1'][n][-1]:.1f} / batch {rates['batch'][n][-1]:.0f}"
                                             for n in configs), flush=True)
    for kind, label in (("b1", "batch-1 decode tok/s (prompt 16 + prefill)"),
                        ("batch", f"batch-{args.batch} output tok/s ({args.batch} x 32 -> {args.batch_tokens})")):
        med = {n: statistics.median(v) for n, v in rates[kind].items()}
        base = next(iter(configs))
        ratio = {n: statistics.median(a / b for a, b in zip(rates[kind][n], rates[kind][base])) for n in configs}
        print(f"{label}: " + ", ".join(f"{n} {med[n]:.1f} ({ratio[n]:.2f}x {base})" for n in configs))
    print("RSS added per engine (weights + touched KV): " + ", ".join(f"{n} {added[n]:.0f} MB" for n in configs))
    return 0
