"""4-bit linear layers on torch's CPU int4 kernel, kept packed: GGUF Q4_0 / Q4_1 (4.5-5 bits per weight) and
GPTQ / AWQ / compressed-tensors W4A16 (``grouped_int4``); INT8 W8A8 is in ``int8.py``.

``aten._weight_int4pack_mm_for_cpu`` computes ``x @ W.T`` with ``W[n, k] = (q - 8) * scale + zero`` per group of
32 along k. A GGUF Q4_1 block stores ``W = d * q + m`` (q in 0..15), so scale = d and zero = m + 8d; Q4_0 stores
``W = d * (q - 8)``, so zero = 0. The nibbles map one to one; only d, m and the zeros are rounded to bf16 (the
kernel's scale dtype), the difference from the reference the conformance suite bounds. The kernel wants bf16
activations (fp32 ones measured 10-20x slower), so fp32 activations are cast around it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F

from pagedllm.hookspec import QuantizedLinearKernel, QuantizedWeight
from pagedllm_cpu import native

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


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` in x's dtype, activations cast to bf16 around the kernel: one C++ call once ``native`` is loaded
    (``csrc/int4_linear.cpp``, the same ATen ops without four Python dispatches), else those ops here."""
    if native.lib is not None:
        return native.lib.int4pack_linear(x, packed, group, scales_zeros)
    shape = x.shape
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), packed, group,
                                                   scales_zeros).to(x.dtype)
    return y.reshape(*shape[:-1], y.shape[-1])


def _apply(state: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    packed, scales_zeros = state
    y = _int4_mm(x, packed, GROUP, scales_zeros)
    if bias is not None:
        y.add_(bias)
    return y


INT4 = QuantizedLinearKernel(_prepare, _apply, name="cpu-int4pack")

logger = logging.getLogger(__name__)
#: Group sizes ``_weight_int4pack_mm_for_cpu`` takes; it also wants out_features divisible by 16.
KERNEL_GROUPS = (32, 64, 128, 256)


def _prepare_grouped(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> tuple:
    """GPTQ / AWQ / compressed-tensors int4 ``W = (q - z) * s`` as the kernel's ``(q - 8) * s + zero``: zero =
    (8 - z) * s. GPTQ ``desc_act`` groups are made contiguous by permuting the input columns once here (and the
    activations per call, as exllama does). Shapes the kernel cannot take run dense (logged)."""
    from pagedllm.quantization import get_method

    g = get_method(weight.method).unpack(weight)
    n, k = g.q.shape
    perm = torch.argsort(g.g_idx, stable=True)
    size = k // g.scales.shape[0] if k % g.scales.shape[0] == 0 else 0
    ok = size in KERNEL_GROUPS and n % 16 == 0 and torch.equal(g.g_idx[perm], torch.arange(k) // size)
    if not ok:
        logger.info("%s %s [%d, %d] (group %s): not a cpu-int4pack shape (out %% 16, group in %s); dense %s",
                    weight.method, weight.weight_type, n, k, size or "uneven", KERNEL_GROUPS, dtype)
        return ("dense", g.dense().to(device=device, dtype=dtype))
    scale_zero = torch.stack([g.scales, (8 - g.zeros) * g.scales], dim=-1).to(torch.bfloat16)
    identity = torch.equal(perm, torch.arange(k))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(g.q[:, perm].contiguous(), 1)
    return ("int4", packed, scale_zero.contiguous(), size, None if identity else perm)


def _apply_grouped(state: tuple, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if state[0] == "dense":
        return F.linear(x, state[1], bias)
    _, packed, scale_zero, size, perm = state
    y = _int4_mm(x if perm is None else x.index_select(-1, perm), packed, size, scale_zero)
    if bias is not None:
        y.add_(bias)
    return y


GROUPED_INT4 = QuantizedLinearKernel(_prepare_grouped, _apply_grouped, name="cpu-int4pack")
#: (method, weight_type) pairs on ``GROUPED_INT4``.
GROUPED_TYPES = {("gptq", "int4"), ("awq", "int4"), ("compressed-tensors", "W4A16")}


def _prepare_fp8(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> tuple:
    """Dequantized once at load (an fp8 -> float conversion per forward costs 40x the matmul on CPU), then packed for
    oneDNN like any dense weight where oneDNN runs ``dtype``."""
    from pagedllm.quantization import dequantize
    from pagedllm_cpu import dense

    w = QuantizedWeight("unquantized", str(dtype).removeprefix("torch."), dequantize(weight).to(dtype), weight.shape)
    if dense.supported(w.weight_type):
        return dense.ONEDNN.apply, dense.ONEDNN.prepare(w, dtype, device)
    return torch.nn.functional.linear, w.data


def _apply_fp8(state: tuple, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    fn, w = state
    return fn(w, x, bias) if fn is not torch.nn.functional.linear else fn(x, w, bias)


FP8 = QuantizedLinearKernel(_prepare_fp8, _apply_fp8, name="cpu-fp8-dequantized")


def quantized_linear(method: str, weight_type: str) -> Optional[QuantizedLinearKernel]:
    """Dense fp32/bf16 on oneDNN packed weights; Q4_0 / Q4_1 and the 4-bit GPTQ / AWQ / compressed-tensors types on
    the int4 kernel, W8A8 on ``int8.py``'s; fp8 dequantized at load onto the dense path; every other type is left to
    core's reference."""
    if method == "unquantized":
        from pagedllm_cpu import dense

        return dense.ONEDNN if dense.supported(weight_type) else None
    if method == "fp8":
        return FP8
    if method == "gguf" and weight_type in _BLOCK_BYTES:
        return INT4
    if (method, weight_type) in GROUPED_TYPES:
        return GROUPED_INT4
    if (method, weight_type) == ("compressed-tensors", "W8A8"):
        from pagedllm_cpu.int8 import W8A8

        return W8A8
    return None
