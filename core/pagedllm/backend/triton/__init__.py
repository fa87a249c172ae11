"""Portable Triton kernels (any GPU Triton targets; the CPU only under ``TRITON_INTERPRET=1``), for any backend whose
tensors Triton can launch on (the GPU plugins). :data:`CAPABILITIES` is what they support.

Nothing here is imported by ``import pagedllm``: a backend imports the submodule it needs, and Triton itself is only
imported when a kernel runs. Submodules:

- ``kv_write``: store new keys/values into paged cache slots.
- ``attention``: one varlen paged-attention kernel for decodes and prefill chunks (causal, GQA, sliding window,
  soft cap, ALiBi), with a split-K (flash-decoding) mode and its reduce kernel for decode-only batches.
- ``fused_ops``: RMSNorm, neox rotary, SiLU-and-mul.
- ``hooks``: pluggy hook implementations mapping the contract's op hooks onto those kernels.
- ``aot_check``: compile every kernel for the GPU targets a caller names, without a GPU
  (``python -m pagedllm.backend.triton.aot_check --target <Triton backend>:<arch>``).
"""

import os

from pagedllm.backend.hookspec import Capabilities

#: What the kernels take.
HEAD_SIZES = (32, 64, 80, 96, 128, 256)
BLOCK_SIZES = (16, 32)
#: Everything a backend on these kernels runs; it narrows this (``dataclasses.replace``) to what it has verified.
#: fp8 KV is stored as bytes and encoded/decoded in integer arithmetic by the kernels (``fp8.py``); MLA runs core's
#: reference MLA hooks on the canonical layout these kernels share.
CAPABILITIES = Capabilities(dtypes=("float32", "float16", "bfloat16"),
                            kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"), head_sizes=HEAD_SIZES,
                            block_sizes=BLOCK_SIZES, graph_capture="decode", sliding_window=True, soft_cap=True,
                            alibi=True, mla=True)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), as in GPU-less tests."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
