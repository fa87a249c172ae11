"""``pagedllm bench kv-offload``: TTFT of a long shared prefix after it was evicted from the device pool — recomputed,
loaded back from the host tier, or from the disk tier (docs/kv-offload.md, issue 31).

One engine per mode (``recompute``: no tier; ``host``: ``kv_offload_gib``; ``disk``: ``kv_offload_dir`` and no host
tier), each with a device pool just large enough for one long prompt. Each engine prefills the shared prefix once.
Every round then, for each mode in turn (the order rotated every round), fills the pool with an unrelated prompt
(every prefix block is evicted — to the tier, where there is one) and times ``prefix + 8 new tokens`` with
``max_tokens=1``: its wall time is the TTFT. Reported per mode: every round's TTFT, the median and the speed-up over
recompute, with the tiers' hit counters (a tier that did not hit is reported as such, not as a speed-up).
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time

MODES = ("recompute", "host", "disk")
NEW_TOKENS = 8


def add_parser(sub) -> None:
    p = sub.add_parser("kv-offload", help="TTFT of a shared prefix after eviction: recompute vs host tier vs disk "
                                          "tier (modes alternated per round)")
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    p.add_argument("--prefix-len", type=int, default=2048, help="tokens of the shared prefix")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--host-gib", type=float, default=1.0, help="host tier size of the host mode")
    p.add_argument("--json", default=None, help="write every round's results as JSON here")
    p.set_defaults(func=main)


def _engine(args, mode: str, folder: str):
    from pagedllm import LLM  # heavy: torch, not at CLI start

    blocks = -(-(args.prefix_len + 12 * args.block_size) // args.block_size)  # one long prompt fills the pool
    kw = {"host": {"kv_offload_gib": args.host_gib}, "disk": {"kv_offload_dir": folder}}.get(mode, {})
    return LLM(args.model, device="cpu", block_size=args.block_size, max_model_len=blocks * args.block_size,
               num_gpu_blocks_override=blocks, **kw)


def main(args) -> int:
    import torch  # heavy: not at CLI start

    from pagedllm import SamplingParams  # heavy: torch, not at CLI start

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--modes: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(MODES)}")
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=g).tolist()

    prefix = rand(args.prefix_len)
    one = SamplingParams(temperature=0, max_tokens=1)
    folders = {m: tempfile.mkdtemp(prefix=f"bench-kv-offload-{m}-") for m in modes}
    engines = {}
    try:
        for m in modes:
            engines[m] = _engine(args, m, folders[m])
            engines[m].generate([{"prompt_token_ids": prefix + rand(NEW_TOKENS)}], one, use_tqdm=False)
        filler = engines[modes[0]].llm_engine.max_model_len - 2
        times: dict[str, list[float]] = {m: [] for m in modes}
        tokens: dict[str, list[list[int]]] = {m: [] for m in modes}
        for r in range(args.rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            query, fill = rand(NEW_TOKENS), rand(filler)
            for m in order:
                llm = engines[m]
                llm.generate([{"prompt_token_ids": fill}], one, use_tqdm=False)  # evicts every prefix block
                t0 = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": prefix + query}], one, use_tqdm=False)
                times[m].append(time.perf_counter() - t0)
                tokens[m].append(list(out[0].outputs[0].token_ids))
            print(f"round {r + 1}: " + ", ".join(f"{m} {times[m][-1]:.3f} s" for m in modes), flush=True)
        stats = {m: engines[m].llm_engine.get_stats().kv_offload for m in modes}
    finally:
        for llm in engines.values():
            llm.shutdown()
        for d in folders.values():
            shutil.rmtree(d, ignore_errors=True)
    base = statistics.median(times["recompute"]) if "recompute" in times else None
    result = {"prefix_len": args.prefix_len, "rounds": args.rounds, "modes": {}}
    print(f"\nTTFT of a {args.prefix_len}-token prefix after eviction (median of {args.rounds} rounds)")
    for m in modes:
        med = statistics.median(times[m])
        hits = {k: v for k, v in (stats[m] or {}).items() if k.endswith("_hits") and v}
        same = all(t == tokens[modes[0]][i] for i, t in enumerate(tokens[m]))
        result["modes"][m] = {"ttft_s": times[m], "median_s": med, "kv_offload": stats[m], "same_tokens": same}
        ratio = f", {base / med:.1f}x recompute" if base and m != "recompute" else ""
        print(f"  {m:9s} {med * 1000:9.1f} ms{ratio}  {hits or ''}{'' if same else '  (tokens differ!)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
