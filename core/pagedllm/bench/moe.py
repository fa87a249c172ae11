"""``pagedllm bench moe``: a backend's ``fused_moe`` against core's reference, alternated, medians per token count."""

from __future__ import annotations

import json
import statistics
import time

import torch


def add_parser(sub) -> None:
    p = sub.add_parser("moe", help="fused MoE op: the backend's vs core's reference (alternated runs)")
    p.add_argument("--device", default="cpu", help="backend name (default cpu)")
    p.add_argument("--tokens", default="1,16,64,512", help="comma-separated token counts")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def _time(fn, device, backend) -> float:
    backend.synchronize(device)
    t0 = time.perf_counter()
    fn()
    backend.synchronize(device)
    return time.perf_counter() - t0


def main(args) -> int:
    from pagedllm.backend import ref_ops  # heavy: torch, not at CLI start
    from pagedllm.backend.registry import get_backend  # heavy: torch, not at CLI start
    from pagedllm.config import DTYPES  # heavy: torch, not at CLI start

    backend = get_backend(args.device)
    device, dtype = backend.device(), DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(device=device, dtype=dtype)
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        x = torch.randn(t, h, generator=g).to(device=device, dtype=dtype)
        probs = torch.softmax(torch.randn(t, e, generator=g), dim=-1)
        weights, ids = probs.topk(k, dim=-1)
        weights, ids = weights.to(device), ids.to(device)
        ops = {"reference": lambda: ref_ops.fused_moe(x, w13, w2, weights, ids),
               args.device: lambda: backend.fused_moe(x, w13, w2, weights, ids)}
        for fn in ops.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(args.repeats):  # alternated, so machine noise hits both alike
            for name, fn in ops.items():
                times[name].append(_time(fn, device, backend))
        ref_ms = statistics.median(times["reference"]) * 1e3
        be_ms = statistics.median(times[args.device]) * 1e3
        rows.append({"tokens": t, "reference_ms": round(ref_ms, 3), f"{args.device}_ms": round(be_ms, 3),
                     "speedup": round(ref_ms / be_ms, 2)})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"fused_moe: E={e} top-{k} hidden={h} intermediate={i} {args.dtype}, median of {args.repeats} "
              f"alternated runs")
        for r in rows:
            print(f"  T={r['tokens']:>5}: reference {r['reference_ms']:8.3f} ms  {args.device} "
                  f"{r[f'{args.device}_ms']:8.3f} ms  speedup {r['speedup']:.2f}x")
    return 0
