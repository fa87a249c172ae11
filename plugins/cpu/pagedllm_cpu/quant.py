"""GGUF Q4_0 / Q4_1 linear layers on torch's CPU int4 kernel, kept packed (4.5-5 bits per weight).

``aten._weight_int4pack_mm_for_cpu`` computes ``x @ W.T`` with ``W[n, k] = (q - 8) * scale + zero`` per group of
32 along k. A GGUF Q4_1 block stores ``W = d * q + m`` (q in 0..15), so scale = d and zero = m + 8d; Q4_0 stores
``W = d * (q - 8)``, so zero = 0. The nibbles map one to one; only d, m and the zeros are rounded to bf16 (the
kernel's scale dtype), the difference from the reference the conformance suite bounds. The kernel wants bf16
activations (fp32 ones measured 10-20x slower), so fp32 activations are cast around it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.hookspec import QuantizedLinearKernel, QuantizedWeight

GROUP = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def _unpack(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 ``[N, K]`` in 0..15, scales_and_zeros bf16 ``[K / 32, N, 2]``) of a Q4_0/Q4_1 weight."""
    n, k = weight.shape
    size = _BLOCK_BYTES[weight.weight_type]
    blocks = weight.data.reshape(n, k // GROUP, size)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    if weight.weight_type == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        zero, qs = m + 8 * d, blocks[..., 4:]
    else:
        zero, qs = torch.zeros_like(d), blocks[..., 2:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, k).to(torch.int32)  # low nibbles first, as ggml
    scales_zeros = torch.stack([d, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return q, scales_zeros


def _prepare(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    q, scales_zeros = _unpack(weight)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros


def _apply(state: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    packed, scales_zeros = state
    shape = x.shape
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), packed, GROUP,
                                                   scales_zeros).to(x.dtype)
    if bias is not None:
        y.add_(bias)
    return y.reshape(*shape[:-1], y.shape[-1])


INT4 = QuantizedLinearKernel(_prepare, _apply, name="cpu-int4pack")


def quantized_linear(method: str, weight_type: str) -> Optional[QuantizedLinearKernel]:
    """Dense fp32/bf16 on oneDNN packed weights; Q4_0 / Q4_1 on the int4 kernel; every other GGUF type is left to
    core's reference."""
    if method == "unquantized":
        from pagedllm_cpu import dense

        return dense.ONEDNN if dense.supported(weight_type) else None
    if method == "gguf" and weight_type in _BLOCK_BYTES:
        return INT4
    return None
