"""Dense linear layers on oneDNN with weights pre-packed once at load (vLLM's CPU GEMM and inductor's freezing do
the same).

Measured on an AMD EPYC (AVX-512, torch 2.13, 2 threads; ``docs/benchmarks.md``): ``F.linear`` goes to MKL, which
ran SmolLM2's decode shapes at 90-150 GFLOP/s fp32 and 28 GFLOP/s bf16, where oneDNN on a packed weight ran
165-200 fp32 and ~300 bf16. The packed weight is an opaque ``torch._mkldnn`` tensor in oneDNN's blocked layout.
Chosen by capability (oneDNN built in; bf16 only where oneDNN has bf16 instructions), never by CPU name.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.backend.hookspec import QuantizedLinearKernel, QuantizedWeight

#: The batch size oneDNN tunes the packed layout for (any batch size runs on it).
BATCH_HINT = 64


def supported(weight_type: str) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if weight_type == "float32":
        return True
    return weight_type == "bfloat16" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _prepare(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.data.to(dtype).contiguous(), BATCH_HINT)


def _apply(packed: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


ONEDNN = QuantizedLinearKernel(_prepare, _apply, name="cpu-onednn-packed")
