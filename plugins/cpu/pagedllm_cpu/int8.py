"""INT8 W8A8 (int8 per-channel weights, dynamic per-token int8 activations) on ``torch._int_mm``.

Activations are quantized per token exactly as core's reference (``pagedllm.quantization.int8``: compressed-tensors'
symmetric grid), multiplied with the int8 weight in int32 (exact), and rescaled: the result equals the reference up
to float32 rounding of the rescale. ``_int_mm`` wants more than 16 rows, so smaller batches are zero-padded to 17.

Measured alternatives (docs/quantization.md, ``pagedllm bench quant-linear --scheme w8a8 --int-mm``): fbgemm's
``quantized.linear_dynamic`` is faster at batch 1 but quantizes activations with one asymmetric uint8 scale per
batch and its results differed from the exact per-token math by ~1e-3 relative per layer (even with rows
normalised to a common range), which compounded to ~2e-2 in a 2-layer model's logits; its quantized-tensor API is
also deprecated. ``aten._weight_int8pack_mm`` is weight-only (no activation quantization: not W8A8).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from pagedllm.backend.hookspec import QuantizedLinearKernel, QuantizedWeight
from pagedllm.backend import quantize_per_token

MIN_ROWS = 17  # torch._int_mm on CPU needs M > 16


def w8a8_linear(x: torch.Tensor, w_t: torch.Tensor, w_scale: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x [.., K]`` times the int8 weight ``w_t [K, N]`` (transposed, contiguous) with per-row scales ``w_scale
    [N]``; per-token int8 activations."""
    shape = x.shape
    xq, sx = quantize_per_token(x.reshape(-1, shape[-1]))
    rows = xq.shape[0]
    xi = F.pad(xq, (0, 0, 0, MIN_ROWS - rows)) if rows < MIN_ROWS else xq
    y = torch._int_mm(xi.to(torch.int8), w_t)[:rows].float() * sx * w_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], -1)


def _prepare(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    from pagedllm.backend import get_method

    g = get_method(weight.method).unpack(weight)
    if g.scales.shape[0] != 1 or bool((g.zeros != 0).any()):
        raise ValueError(f"{weight.method} {weight.weight_type}: W8A8 needs symmetric per-channel int8 weights")
    return g.q.to(torch.int8).t().contiguous(), g.scales[0].float().reshape(1, -1)


W8A8 = QuantizedLinearKernel(_prepare, lambda state, x, bias: w8a8_linear(x, state[0], state[1], bias),
                             name="cpu-int8-int_mm")
