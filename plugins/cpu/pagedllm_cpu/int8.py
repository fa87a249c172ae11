"""INT8 W8A8 (int8 per-channel weights, dynamic per-token int8 activations) on fbgemm's dynamic quantized linear.

``quantized.linear_dynamic`` quantizes activations with one asymmetric uint8 scale for the whole batch; the
checkpoint's scheme is one symmetric int8 scale per token. The two are made equal exactly: each row is divided by
its own max|x| (so every row spans [-1, 1]) and one extra row ``[1, -1, 0, ...]`` pins the batch's range to exactly
[-1, 1], so fbgemm picks scale 2/255 = 1/127.5 and zero point 128, i.e. per row ``round(x / max|x| * 127.5)`` on
the symmetric grid; the output rows are multiplied back by max|x|. Measured against fp32 dense, ``torch._int_mm``
and the exact float reference in docs/quantization.md (``pagedllm bench w8a8``). fbgemm's quantized-tensor API
warns it is deprecated (torchao is its successor, not installed here); the kernel stays behind this one module.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from pagedllm.hookspec import QuantizedLinearKernel, QuantizedWeight


def prepack(w_q: torch.Tensor, w_scale: torch.Tensor) -> Any:
    """fbgemm's packed weight of int8 ``w_q [N, K]`` with per-row scales ``w_scale [N]`` (zero points 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(w_q.to(torch.int8), w_scale.double(),
                                                      torch.zeros(w_q.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qw, None)


def w8a8_linear(x: torch.Tensor, packed: Any, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x [.., K]`` through the packed int8 weight with per-token int8 activation quantization."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    amax = x2.abs().amax(dim=1, keepdim=True)
    amax = torch.where(amax == 0, torch.ones_like(amax), amax)
    pin = torch.zeros(1, shape[-1])
    pin[0, 0], pin[0, -1] = 1.0, -1.0
    y = torch.ops.quantized.linear_dynamic(torch.cat([x2 / amax, pin]), packed, False)[:-1] * amax
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], -1)


def _prepare(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> Any:
    from pagedllm.quantization import get_method

    g = get_method(weight.method).unpack(weight)
    if g.scales.shape[0] != 1 or bool((g.zeros != 0).any()):
        raise ValueError(f"{weight.method} {weight.weight_type}: W8A8 needs symmetric per-channel int8 weights")
    return prepack(g.q, g.scales[0])


W8A8 = QuantizedLinearKernel(_prepare, lambda packed, x, bias: w8a8_linear(x, packed, bias), name="cpu-fbgemm-w8a8")
