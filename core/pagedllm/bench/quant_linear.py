"""``pagedllm bench quant-linear``: one quantized linear layer on the backend's kernel against dense float32 and
core's reference, alternated, medians per batch size (docs/quantization.md)."""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.nn.functional as F

#: --scheme -> (method, weight_type)
#: --scheme -> (method, weight_type); the layouts of ``pagedllm.quantization.rtn.random_weight`` (GPTQ: act-order
#: groups of 128, AWQ: groups of 64, W4A16: groups of 32).
SCHEMES = {"w8a8": ("compressed-tensors", "W8A8"), "gptq-int4": ("gptq", "int4"), "awq-int4": ("awq", "int4"),
           "w4a16": ("compressed-tensors", "W4A16")}


def add_parser(sub) -> None:
    p = sub.add_parser("quant-linear", help="a quantized linear layer: backend kernel vs dense fp32 vs reference")
    p.add_argument("--device", default="cpu", help="backend name (default cpu)")
    p.add_argument("--scheme", default="w8a8", choices=sorted(SCHEMES))
    p.add_argument("--shape", default="4096x4096", help="OUTxIN (default 4096x4096)")
    p.add_argument("--tokens", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--int-mm", action="store_true", help="also time torch._int_mm with per-token quantization "
                                                         "(the W8A8 alternative kernel considered)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(args) -> int:
    from pagedllm.backend.registry import get_backend  # heavy: torch, not at CLI start
    from pagedllm.quantization import dequantize, reference_kernel  # heavy: torch, not at CLI start
    from pagedllm.quantization.int8 import quantize_per_token  # heavy: torch, not at CLI start
    from pagedllm.quantization.rtn import random_weight  # heavy: torch, not at CLI start

    backend = get_backend(args.device)
    device = backend.device()
    n, k = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    weight = random_weight(*SCHEMES[args.scheme], n, k, gen)
    kernel = backend.quantized_linear(weight.method, weight.weight_type)
    if kernel is None:
        raise SystemExit(f"backend {args.device!r} has no {weight.method} {weight.weight_type} kernel")
    ref = reference_kernel(weight.method, weight.weight_type)
    state, ref_state = kernel.prepare(weight, torch.float32, device), ref.prepare(weight, torch.float32, device)
    dense = dequantize(weight).to(device)
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, k, generator=gen).to(device)
        ops = {"fp32": lambda: F.linear(x, dense), kernel.name: lambda: kernel.apply(state, x, None),
               "reference": lambda: ref.apply(ref_state, x, None)}
        if args.int_mm:
            w_q = weight.data["weight"].t().contiguous() if args.scheme == "w8a8" else None

            def int_mm():
                xq, sx = quantize_per_token(x)
                pad = max(0, 17 - xq.shape[0])  # _int_mm wants more than 16 rows
                xi = F.pad(xq, (0, 0, 0, pad)).to(torch.int8)
                return torch._int_mm(xi, w_q)[: xq.shape[0]].float() * sx * weight.data["weight_scale"].t()
            ops["torch._int_mm"] = int_mm
        want = ops["reference"]()
        errs = {name: ((fn().float() - want.float()).norm() / want.float().norm()).item() for name, fn in ops.items()}
        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(args.repeats):  # alternated: machine noise hits every op alike
            for name, fn in ops.items():
                backend.synchronize(device)
                t0 = time.perf_counter()
                fn()
                backend.synchronize(device)
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        rows.append({"tokens": t, **{f"{name}_ms": round(v, 3) for name, v in med.items()},
                     **{f"{name}_vs_fp32": round(med["fp32"] / v, 2) for name, v in med.items() if name != "fp32"},
                     **{f"{name}_rel_err_vs_reference": float(f"{e:.2e}") for name, e in errs.items()}})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{args.scheme} ({weight.method} {weight.weight_type}) {n}x{k} on {args.device}, median of {args.repeats} "
          f"alternated runs; speed = fp32 time / op time, error = relative to core's reference")
    for r in rows:
        parts = [f"{name} {r[f'{name}_ms']:.3f} ms" + (f" ({r[f'{name}_vs_fp32']:.2f}x, err "
                                                          f"{r[f'{name}_rel_err_vs_reference']:.1e})"
                                                          if name != "fp32" else "")
                 for name in [c.removesuffix("_ms") for c in r if c.endswith("_ms")]]
        print(f"  T={r['tokens']:>4}: " + "  ".join(parts))
    return 0
