"""INT8 W8A8: int8 weights with per-output-channel scales, activations quantized to int8 per token at run time.

The reference here is the exact integer math done in float32: each token row ``x`` gets ``s_x = max|x| / 127.5``
(compressed-tensors' symmetric int8 range, so its checkpoints and this agree), ``x_q = clamp(round(x / s_x), -128,
127)``; then ``y = (x_q @ w_q.T) * s_x * s_w``. Products of int8 values summed in float32 are exact while
``K * 128 * 128 < 2**24`` (K <= 1024) and within float32 rounding beyond. Backend kernels are checked against it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.backend.hookspec import QuantizedLinearKernel
from pagedllm.quantization.base import get_method

#: compressed-tensors' symmetric int8 scale divisor: (127 - (-128)) / 2.
INT8_HALF_RANGE = 127.5


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values as float32 ``[T, K]``, float32 scales ``[T, 1]``) of activations ``x``."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = amax / INT8_HALF_RANGE
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    return torch.clamp(torch.round(x / scale), -128, 127), scale


def w8a8_reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x [.., K]`` (any float dtype) times int8 ``w_q [N, K]`` with float ``w_scale [N]``, exact int8 math in
    float32, returned in ``x``'s dtype."""
    shape = x.shape
    xq, sx = quantize_per_token(x.reshape(-1, shape[-1]))
    y = (xq @ w_q.float().t()) * sx * w_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], -1)


def _prepare(weight: Any, dtype: torch.dtype, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    g = get_method(weight.method).unpack(weight)
    if g.scales.shape[0] != 1 or bool((g.zeros != 0).any()):
        raise ValueError(f"{weight.method} {weight.weight_type}: W8A8 needs symmetric per-channel int8 weights")
    return g.q.float().to(device), g.scales[0].float().to(device)  # int8 values held as float32: no cast per call


def _apply(state: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return w8a8_reference(x, state[0], state[1], bias)


#: Core's W8A8 kernel: the exact math above with the int8 weight values held in float32 (no memory saved, dense
#: float32 speed); it is the oracle, backends bring the fast kernel.
W8A8_REFERENCE = QuantizedLinearKernel(_prepare, _apply, name="reference(w8a8)")


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric int8 of a float ``[N, K]`` weight: (int8 ``[N, K]``, float32 scales ``[N, 1]``),
    compressed-tensors' channel strategy (test checkpoints and the bench write W8A8 with it)."""
    amax = w.float().abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / INT8_HALF_RANGE)
    return torch.clamp(torch.round(w.float() / scale), -128, 127).to(torch.int8), scale
