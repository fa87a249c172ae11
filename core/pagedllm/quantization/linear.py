"""``QuantizedLinear``: an ``nn.Linear`` stand-in whose weight stays packed, run by the backend's kernel."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.quantization.base import reference_kernel

logger = logging.getLogger(__name__)
_warned: set[tuple[str, str, str]] = set()


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` in a packed layout; ``state`` is whatever the kernel's ``prepare`` built."""

    def __init__(self, weight: QuantizedWeight, bias: bool, kernel: Any, state: Any):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.method, self.weight_type, self.kernel_name = weight.method, weight.weight_type, kernel.name
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self._apply_kernel = kernel.apply
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_kernel(self.state, x, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.method}:"
                f"{self.weight_type}, kernel={self.kernel_name}")


class SplitQuantizedLinear(nn.Module):
    """A fused linear whose checkpoint parts are packed in different block types (a Q4_K_M GGUF stores q and k as
    Q4_K beside a Q6_K v): one ``QuantizedLinear`` per part, outputs joined, so no part is dequantized at load."""

    def __init__(self, parts: list[QuantizedLinear], bias: bool):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features, self.in_features = sum(p.out_features for p in parts), parts[0].in_features
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y.add_(self.bias)


def make_quantized_linear(backend: Any, weight: QuantizedWeight, bias: bool, dtype: torch.dtype,
                          device: Any) -> QuantizedLinear:
    """The backend's kernel for ``weight``'s method and type, else core's reference (logged once per pair)."""
    kernel = backend.quantized_linear(weight.method, weight.weight_type)
    if kernel is None:
        key = (backend.name, weight.method, weight.weight_type)
        if key not in _warned:
            _warned.add(key)
            logger.warning("no %s %s kernel on %s; using reference (dequantized at load)", weight.method,
                           weight.weight_type, backend.name)
        kernel = reference_kernel(weight.method, weight.weight_type)
    return QuantizedLinear(weight, bias, kernel, kernel.prepare(weight, dtype, device))


def kernel_of(module: nn.Module) -> Optional[str]:
    return getattr(module, "kernel_name", None)
