"""Portable Triton kernels (any GPU Triton targets; the CPU only under ``TRITON_INTERPRET=1``), for any backend whose
tensors Triton can launch on (the GPU plugins).

Nothing here is imported by ``import pagedllm``: a backend imports the submodule it needs, and Triton itself is only
imported when a kernel runs. Submodules:

- ``kv_write``: store new keys/values into paged cache slots.
- ``attention``: one varlen paged-attention kernel for decodes and prefill chunks (causal, GQA, sliding window,
  soft cap, ALiBi), with a split-K (flash-decoding) mode and its reduce kernel for decode-only batches.
- ``fused_ops``: RMSNorm, neox rotary, SiLU-and-mul.
- ``hooks``: pluggy hook implementations mapping the contract's op hooks onto those kernels.
- ``aot_check``: compile every kernel for sm_80/sm_90/gfx942 without a GPU (``python -m pagedllm.backend.triton.aot_check``).
"""

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), as in GPU-less tests."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
