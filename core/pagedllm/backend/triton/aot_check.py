"""Compile every Triton kernel ahead of time for GPU targets, no GPU needed (Triton bundles its backends' assemblers
and linkers): catches compile errors of the real GPU code path, which the CPU interpreter never sees.

``python -m pagedllm.backend.triton.aot_check --target BACKEND:ARCH ...`` (run without ``TRITON_INTERPRET``): each
target as Triton names it (its backend's ``get_target_name``); the GPU plugins' docs and tests name theirs.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pagedllm.backend.triton import interpreting

_INT_PTRS = {"block_tables_ptr": "i32", "seq_lens_ptr": "i32", "qsl_ptr": "i32", "slot_ptr": "i64",
             "pos_ptr": "i64", "part_acc_ptr": "fp32", "part_max_ptr": "fp32", "part_sum_ptr": "fp32",
             "alibi_ptr": "fp32"}
_FLOATS = {"scale", "soft_cap", "eps", "v_scale", "inv_k_scale", "inv_v_scale"}


def _signature(kernel: Any, dtype: str, cx: dict) -> dict[str, str]:
    sig = {}
    for name in kernel.arg_names:
        if name.isupper():
            sig[name] = "constexpr"
        elif name == "cache_ptr" and (cx.get("FP8") or cx.get("KV_FP8")):  # fp8 caches travel as uint8 views
            sig[name] = "*u8"
        elif name.endswith("_ptr"):
            sig[name] = "*" + _INT_PTRS.get(name, dtype)
        else:
            sig[name] = "fp32" if name in _FLOATS else "i32"
    return sig


def configs() -> list[tuple[str, Any, str, dict]]:
    """(label, kernel, element dtype, constexprs) covering each kernel's distinct code paths."""
    from pagedllm.backend.triton import attention, fused_ops, kv_write  # heavy: triton

    out = []
    for dt in ("fp16", "bf16", "fp32"):
        for segs, extras in ((1, True), (16, False)):
            cx = dict(HEAD_PAD=128, BLOCK_M=16, TILE=32, NUM_SEGMENTS=segs, USE_WINDOW=extras, USE_SOFT_CAP=extras,
                      USE_ALIBI=extras, UPCAST=False, FP32_DOT=dt == "fp32")
            out.append((f"paged_attention {dt} segments={segs} window/cap/alibi={extras}",
                        attention._paged_attention_kernel, dt, cx))
    out.append(("paged_attention fp16 head 256 gqa 32", attention._paged_attention_kernel, "fp16",
                dict(HEAD_PAD=256, BLOCK_M=32, TILE=16, NUM_SEGMENTS=1, USE_WINDOW=False, USE_SOFT_CAP=False,
                     USE_ALIBI=False, UPCAST=False, FP32_DOT=False)))
    out.append(("paged_attention bf16 fp8 KV (e4m3)", attention._paged_attention_kernel, "bf16",
                dict(HEAD_PAD=128, BLOCK_M=16, TILE=32, NUM_SEGMENTS=16, USE_WINDOW=False, USE_SOFT_CAP=False,
                     USE_ALIBI=False, UPCAST=False, FP32_DOT=False, KV_FP8=True, MANT=3, BIAS=7)))
    out.append(("reduce_segments bf16", attention._reduce_segments_kernel, "bf16", dict(HEAD_PAD=128, NUM_SEGMENTS=16)))
    out.append(("write_kv bf16", kv_write._write_kv_kernel, "bf16", dict(HEADS_PAD=8, HEAD_PAD=128)))
    out.append(("write_kv bf16 fp8 KV (e5m2)", kv_write._write_kv_kernel, "bf16",
                dict(HEADS_PAD=8, HEAD_PAD=128, FP8=True, MANT=2, BIAS=15, FMAX=57344.0)))
    out.append(("write_kv fp16 one kv head", kv_write._write_kv_kernel, "fp16", dict(HEADS_PAD=1, HEAD_PAD=64)))
    out.append(("rms_norm bf16", fused_ops._rms_norm_kernel, "bf16", dict(BLOCK=4096)))
    out.append(("silu_and_mul bf16", fused_ops._silu_and_mul_kernel, "bf16", dict(BLOCK=1024)))
    out.append(("rotary bf16", fused_ops._rotary_kernel, "bf16", dict(HEADS_PAD=32, HALF_PAD=64)))
    return out


def parse_target(text: str) -> Any:
    """``BACKEND:ARCH`` -> Triton's ``GPUTarget``: a numeric arch as a number, the warp size the backend's compiler
    options give that arch (Triton compiles with those, whatever the target says)."""
    from triton.backends import backends  # heavy: triton
    from triton.backends.compiler import GPUTarget  # heavy: triton

    backend, _, arch_text = text.partition(":")
    compilers = {b.compiler for b in backends.values() if b.compiler.supports_target(GPUTarget(backend, 0, 0))}
    if not arch_text or not compilers:
        raise ValueError(f"target {text!r}: expected <backend>:<arch> for a backend of the installed Triton")
    arch: Any = int(arch_text) if arch_text.isdigit() else arch_text
    warp_size = compilers.pop()(GPUTarget(backend, arch, 0)).parse_options({}).warp_size
    return GPUTarget(backend, arch, warp_size)


def compile_all(targets: list[str]) -> list[tuple[str, str, str]]:
    """[(target, label, '' or error)] for every config on every target."""
    import triton  # heavy: triton
    from triton.compiler import ASTSource  # heavy: triton

    results = []
    for text in targets:
        target = parse_target(text)
        for label, kernel, dt, cx in configs():
            try:
                triton.compile(ASTSource(kernel, _signature(kernel, dt, cx), cx), target=target)
                results.append((text, label, ""))
            except Exception as e:
                results.append((text, label, f"{type(e).__name__}: {e}"))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedllm.backend.triton.aot_check", description=__doc__)
    p.add_argument("--target", action="append", required=True,
                   help="<Triton backend>:<arch>, as Triton's get_target_name prints it (repeatable)")
    args = p.parse_args(argv)
    if interpreting():
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = compile_all(args.target)
    for target, label, err in results:
        print(f"{'ok  ' if not err else 'FAIL'} {target:<11} {label}{'  ' + err if err else ''}")
    failed = sum(bool(e) for _, _, e in results)
    print(f"{len(results) - failed}/{len(results)} compiled in {time.perf_counter() - t0:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
