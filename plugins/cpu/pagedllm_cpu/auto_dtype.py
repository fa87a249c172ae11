"""What ``--dtype auto`` runs on the CPU backend: bf16 where both the checkpoint and the CPU make it the fast path,
float32 everywhere else (the exact path, and the fast one on CPUs without bf16 instructions).

bf16 halves the bytes every weight and KV row streams, and oneDNN's packed bf16 linears run on AMX tiles
(``amx_bf16``) or bf16 dot products (``avx512_bf16``; Arm ``bf16``): 1.5-1.9x fp32 end to end on such CPUs
(docs/cpu-backend.md). oneDNN also reports bf16 as supported on AVX-512 CPUs without those instructions, where it
emulates it more slowly than fp32, so the choice needs the instruction flags as well as oneDNN's answer. Decided by
capability, never by the CPU's name. A checkpoint stored in float32 stays float32 (rounding it would change the
model), and so does a quantized one (GGUF and the int4/int8 kernels take float32 activations; core's quantized
reference is float32; GGUF prefill chunks run as bf16 GEMMs where the CPU has bf16, ``quant.bf16_min_rows``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

import torch

from pagedllm_cpu import platform

logger = logging.getLogger(__name__)

#: CPU flags (``/proc/cpuinfo``) of native bf16 arithmetic: AMX tiles, AVX-512 bf16 dot products, Arm's BF16 extension.
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
#: Checkpoint dtypes that run in bf16 under ``auto`` where the CPU has it (fp16: the same 16 bits per weight).
HALF_CHECKPOINTS = ("bfloat16", "float16")


@dataclass(frozen=True)
class BF16Support:
    """Whether this CPU runs bf16 natively, and the evidence (for the log line)."""

    native: bool
    why: str


@lru_cache(maxsize=1)
def bf16_support() -> BF16Support:
    """Native bf16 = oneDNN has bf16 kernels here *and* the CPU reports a bf16 instruction flag."""
    flags = [f for f in BF16_FLAGS if f in platform.cpu_flags()]
    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if flags and onednn:
        return BF16Support(True, f"this CPU has bf16 instructions ({', '.join(flags)})")
    if not flags:
        return BF16Support(False, f"this CPU has no bf16 instructions (none of {', '.join(BF16_FLAGS)})")
    return BF16Support(False, f"oneDNN has no bf16 kernels in this torch (the CPU has {', '.join(flags)})")


def resolve_auto_dtype(checkpoint_dtype: str, quantization: str | None, support: BF16Support) -> tuple[str, str]:
    """(dtype, reason) that ``dtype="auto"`` runs for a checkpoint stored in ``checkpoint_dtype``, quantized with
    ``quantization`` (None: dense), on a CPU with ``support``."""
    if quantization is not None:
        return "float32", f"the checkpoint is {quantization}-quantized (its kernels take float32 activations)"
    if checkpoint_dtype not in HALF_CHECKPOINTS:
        return "float32", f"the checkpoint is {checkpoint_dtype}"
    if not support.native:
        return "float32", f"the checkpoint is {checkpoint_dtype} but {support.why}"
    return "bfloat16", f"the checkpoint is {checkpoint_dtype} and {support.why}"


def choose(checkpoint_dtype: str, quantization: str | None) -> str:
    """``resolve_auto_dtype`` on this CPU, logged in one line (the dtype and why)."""
    dtype, why = resolve_auto_dtype(checkpoint_dtype, quantization, bf16_support())
    logger.info("dtype auto -> %s on cpu: %s (pass --dtype to choose)", dtype, why)
    return dtype
