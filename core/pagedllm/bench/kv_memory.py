"""``pagedllm bench kv-memory``: KV bytes one request holds at a long context, with and without sliding-window KV
groups (sched/kv_groups.py) — a memory figure, not a timing.

For a preset of ``pagedllm bench random-model`` that has sliding-window layers (default ``gemma3-1b``: 26 layers,
5 local (window 512) per global, 1 KV head of 256), it writes a seeded random model with the preset's *KV shape*
(layers, layer types, window, KV heads, head size) and small hidden sizes, which change no KV byte but let the CPU
run an 8k-token prompt. One engine per mode runs the same prompt (chunked prefill at the engine's default budget)
and two decode steps, and reads the KV manager after each step:

* ``one table``: ``disable_hybrid_kv_cache_manager`` — every layer shares one block table, so a sliding layer keeps
  every block of the sequence (what the engine did before KV groups);
* ``kv groups``: the layers grouped by kind, blocks that left a window returned to the pool.

Reported per mode: block size in bytes (a block id spans all layers, or one group's ``group_size``), blocks held at
the decode step at ``--tokens`` context (steady state) and at the peak (the last prefill chunk: a sliding group then
holds its window plus the chunk), both in MiB; and beside them the expected ratio of the two modes,
``(global + local * W / T) / layers``.
"""

from __future__ import annotations

import json
import shutil
import tempfile


def add_parser(sub) -> None:
    p = sub.add_parser("kv-memory", help="KV bytes one request holds at a long context, with and without "
                                         "sliding-window KV groups (freed blocks back to the pool)")
    p.add_argument("--preset", default="gemma3-1b", help="a random-model preset with sliding-window layers")
    p.add_argument("--tokens", type=int, default=8192, help="prompt tokens (the context measured)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the prefill chunk (token budget)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="write the figures as JSON here")
    p.set_defaults(func=main)


def kv_shape_model(preset: str, out: str, seed: int = 0) -> dict:
    """Write ``preset``'s KV shape as a small random HF model in ``out``; returns its config fields."""
    import torch  # heavy: not at CLI start
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: transformers

    from pagedllm.bench.random_model import PRESETS

    if preset not in PRESETS:
        raise SystemExit(f"--preset: {preset!r} is not one of {sorted(PRESETS)}")
    kwargs = dict(PRESETS[preset][1])
    if not kwargs.get("sliding_window"):
        raise SystemExit(f"--preset: {preset} has no sliding-window layers")
    # KV bytes depend on layers, layer types, window, KV heads and head size only: keep those, shrink the rest
    kwargs.update(hidden_size=64, intermediate_size=128, vocab_size=512, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if "head_dim" not in kwargs:
        kwargs["head_dim"] = PRESETS[preset][1]["hidden_size"] // PRESETS[preset][1]["num_attention_heads"]
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return config.to_dict()


def measure(path: str, tokens: int, block_size: int, dtype: str, device: str, grouped: bool,
            chunk: int = 2048) -> dict:
    """One engine, one request of ``tokens`` prompt tokens and two decode steps: blocks held after each step."""
    import torch  # heavy: not at CLI start

    from pagedllm import LLM, SamplingParams

    max_len = tokens + 2 * block_size
    llm = LLM(path, device=device, dtype=dtype, block_size=block_size, max_model_len=max_len, max_num_seqs=1,
              max_num_batched_tokens=chunk,
              skip_tokenizer_init=True, enable_prefix_caching=False, disable_hybrid_kv_cache_manager=not grouped)
    engine = llm.llm_engine
    kv, worker = engine.kv, engine.worker
    prompt = torch.randint(3, 500, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3,
                                                                         ignore_eos=True))
    req = engine.scheduler.waiting[0]
    steps = []
    while engine.has_unfinished_requests():
        context = req.num_computed_tokens  # before the step: what its allocation saw as written
        engine.step()
        steps.append((context, kv.num_used_blocks if not req.is_finished else steps[-1][1]))
    bpb = worker.kv_spec.bytes_per_block
    steady = next(b for c, b in steps if c >= tokens)  # the decode step at ``tokens`` context
    peak = max(b for _, b in steps)
    layout = worker.kv_layout
    out = dict(mode="kv groups" if grouped else "one table", layout=layout.describe() if layout is not None else
               "one block table for all layers", bytes_per_block=bpb, blocks_steady=steady, blocks_peak=peak,
               mib_steady=steady * bpb / 2**20, mib_peak=peak * bpb / 2**20, steps=len(steps),
               freed_by_window=getattr(kv, "num_freed_by_window", 0))
    llm.llm_engine.shutdown()
    return out


def expected_ratio(config: dict, tokens: int) -> float:
    """KV held with freeing over without: (global layers + local layers * min(W, T) / T) / layers."""
    types = config.get("layer_types") or []
    local = sum(t == "sliding_attention" for t in types)
    return ((len(types) - local) + local * min(config["sliding_window"], tokens) / tokens) / len(types)


def main(args) -> int:
    folder = tempfile.mkdtemp(prefix="pagedllm-kv-memory-")
    try:
        config = kv_shape_model(args.preset, folder)
        rows = [measure(folder, args.tokens, args.block_size, args.dtype, args.device, grouped,
                        args.max_num_batched_tokens) for grouped in (False, True)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    base = rows[0]
    ratio = expected_ratio(config, args.tokens)
    print(f"{args.preset} KV shape ({len(config['layer_types'])} layers, window {config['sliding_window']}, "
          f"{config['num_key_value_heads']} KV head(s) of {config['head_dim']}), {args.dtype}, block "
          f"{args.block_size}, one request of {args.tokens} prompt tokens, prefill chunks of "
          f"{args.max_num_batched_tokens}")
    print(f"{'mode':<10} {'block KiB':>9} {'steady blocks':>13} {'steady MiB':>11} {'peak MiB':>9} "
          f"{'vs one table':>13}")
    for r in rows:
        print(f"{r['mode']:<10} {r['bytes_per_block'] / 1024:>9.0f} {r['blocks_steady']:>13} {r['mib_steady']:>11.1f} "
              f"{r['mib_peak']:>9.1f} {r['mib_steady'] / base['mib_steady']:>12.3f}x")
    for r in rows:
        print(f"  {r['mode']}: {r['layout']}")
    print(f"expected (global + local * W / T) / layers = {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, tokens=args.tokens, block_size=args.block_size, dtype=args.dtype,
                           max_num_batched_tokens=args.max_num_batched_tokens, expected_ratio=ratio, rows=rows),
                      f, indent=1)
    return 0

