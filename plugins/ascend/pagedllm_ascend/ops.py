"""Fused norm and activation through torch-npu, as vllm-ascend's custom ops call them. Not verified on hardware.
Rotary stays on core's torch reference (runs on the ``npu`` device through torch-npu's aten kernels)."""

from __future__ import annotations

import torch

from pagedllm_ascend.vendor import torch_npu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # vllm-project/vllm-ascend vllm_ascend/ops/layernorm.py (v0.11.0, AscendRMSNorm.forward_oot):
    # x, _ = torch_npu.npu_rms_norm(x, self.weight, self.variance_epsilon); the second output is 1/rms.
    out, _ = torch_npu().npu_rms_norm(x, weight, eps)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # vllm-project/vllm-ascend vllm_ascend/ops/activation.py (v0.11.0, AscendSiluAndMul.forward_oot):
    # torch_npu.npu_swiglu(x) = silu(x[..., :d]) * x[..., d:].
    return torch_npu().npu_swiglu(x)
