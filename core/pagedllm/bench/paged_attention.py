"""``pagedllm bench paged-attention``: a backend's decode attention on a pure-decode step at a model's shape, against
the K/V bytes the step must read and the backend's streaming-read bandwidth (the step's floor), per context length.

Why: a decode step's attention reads every sequence's whole K/V once. At SmolLM2-1.7B's shape (32 KV heads, head
size 64, bf16: 8 KiB a token a layer) and batch 64, that is 100 MB a layer at 192 tokens of context and 1 GB at
2,048: past a few hundred tokens it, not the GEMMs, grows the step. The blocks are drawn at random from a pool far
larger than the last-level cache, as a long-running server's free list leaves them, and each timed call reads
blocks the call before it did not. The first call's output is checked against core's reference op.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (a tiny test shape's times are microseconds)."""
    return float(f"{x:.4g}")


def add_parser(sub) -> None:
    p = sub.add_parser("paged-attention", help="decode attention: the backend's op at a model shape against the "
                                               "streaming-read floor of the K/V it reads")
    p.add_argument("--device", default="cpu", help="backend name (default cpu)")
    p.add_argument("--batch", type=int, default=64, help="sequences decoding (one query token each)")
    p.add_argument("--context-lens", default="192,1024,2048", help="comma-separated context lengths (tokens)")
    p.add_argument("--num-heads", type=int, default=32, help="query heads (default: SmolLM2-1.7B's)")
    p.add_argument("--num-kv-heads", type=int, default=32)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", help="the KV cache's and the queries' dtype")
    p.add_argument("--pool-gib", type=float, default=2.0,
                   help="the KV pool the blocks are drawn from (GiB; it must hold two calls' blocks)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(args) -> int:
    from pagedllm.backend import ref_ops  # heavy: torch, not at CLI start
    from pagedllm.backend.attention import AttentionMetadata
    from pagedllm.backend.registry import get_backend
    from pagedllm.bench.latency import stream_read_bandwidth, stream_read_op
    from pagedllm.config import DTYPES

    backend = get_backend(args.device)
    device, dtype = backend.device(), DTYPES[args.dtype]
    b, h, hkv, d, bs = args.batch, args.num_heads, args.num_kv_heads, args.head_size, args.block_size
    if h % hkv:
        print(f"--num-heads {h} is not a multiple of --num-kv-heads {hkv}")
        return 2
    block_bytes = 2 * bs * hkv * d * dtype.itemsize
    num_blocks = int(args.pool_gib * (1 << 30)) // block_bytes
    ctxs = [int(x) for x in args.context_lens.split(",")]
    most = b * -(-max(ctxs) // bs)
    if 2 * most > num_blocks:  # two calls' blocks, so that consecutive calls read distinct ones
        print(f"--pool-gib {args.pool_gib:g} holds {num_blocks} blocks; two calls of batch {b} x context {max(ctxs)} "
              f"need {2 * most}")
        return 2
    g = torch.Generator().manual_seed(0)
    cache = torch.empty(2, num_blocks, bs, hkv, d, dtype=dtype)
    for half in cache:  # one half at a time: a float32 copy of the whole pool would double its memory
        half.copy_(torch.randn(half.shape, generator=g))
    cache = cache.to(device)
    query = torch.randn(b, h, d, generator=g).to(device=device, dtype=dtype)
    scale = d ** -0.5
    rows, gb_s = [], None
    for ctx in ctxs:
        nb = -(-ctx // bs)
        perm = torch.randperm(num_blocks, generator=g)
        metas = []
        for r in range(args.repeats + 1):  # each call's blocks are new to it: distinct from the call before's
            ids = perm.roll(-r * b * nb % num_blocks)[: b * nb].view(b, nb).tolist()
            metas.append(AttentionMetadata.build([1] * b, [ctx] * b, ids, bs, device=device))
        got = backend.paged_attention(query, cache, metas[0], scale, None, None, 1.0, 1.0)
        want = ref_ops.paged_attention(query, cache, metas[0], scale, None, None)
        err = (got.float() - want.float()).abs().max().item()
        if not err <= _TOL[dtype]:
            print(f"context {ctx}: the backend's output is {err:.3g} from the reference (tolerance {_TOL[dtype]})")
            return 1
        if not rows:  # the backend's op library is loaded now (its first call loads it)
            op = stream_read_op(backend.name)
            gb_s = stream_read_bandwidth(op) / 1e9 if op is not None else None
        times = []
        for meta in metas[1:]:
            backend.synchronize(device)
            t0 = time.perf_counter()
            backend.paged_attention(query, cache, meta, scale, None, None, 1.0, 1.0)
            backend.synchronize(device)
            times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        kv_bytes = b * ctx * 2 * hkv * d * dtype.itemsize
        row = {"context": ctx, "ms": _sig(sec * 1e3), "kv_mb": round(kv_bytes / 1e6, 1),
               "gb_s": _sig(kv_bytes / sec / 1e9), "max_abs_err": err}
        if gb_s:
            row["floor_ms"] = _sig(kv_bytes / (gb_s * 1e9) * 1e3)
            row["floor_reached_pct"] = round(100 * kv_bytes / sec / (gb_s * 1e9), 1)
        rows.append(row)
    result = {"device": args.device, "batch": b, "num_heads": h, "num_kv_heads": hkv, "head_size": d,
              "block_size": bs, "dtype": args.dtype, "pool_gib": args.pool_gib, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "stream_read_gb_s": round(gb_s, 2) if gb_s else None,
              "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"paged decode attention, {args.device}: batch {b}, {h} heads / {hkv} KV heads x {d}, block {bs}, "
          f"{args.dtype}, blocks at random from a {args.pool_gib:g} GiB pool; median of {args.repeats} calls, "
          f"{result['threads']} threads; streaming read "
          + (f"{gb_s:.1f} GB/s" if gb_s else "not measured (the backend registers no stream_read op)"))
    for r in rows:
        floor = (f", floor {r['floor_ms']:.2f} ms ({r['floor_reached_pct']:.0f}% reached)"
                 if "floor_ms" in r else "")
        print(f"  context {r['context']:>6}: {r['ms']:8.2f} ms for {r['kv_mb']:8.1f} MB of K/V = "
              f"{r['gb_s']:6.1f} GB/s{floor}")
    return 0
