"""The method interface, the registry of implemented methods, and the reference kernel every backend falls back to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
import torch.nn.functional as F

from pagedllm.hookspec import QuantizedLinearKernel, QuantizedWeight


class QuantizationMethod(ABC):
    """One scheme: which weight types it keeps packed, and their exact dense meaning (the oracle of every kernel)."""

    name: str = ""

    @abstractmethod
    def weight_types(self) -> tuple[str, ...]:
        """The packed types this method's linear layers may hold (kernels are asked per type)."""

    @abstractmethod
    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        """The dense float32 ``[out_features, in_features]`` weight ``weight`` stands for."""


_METHODS: dict[str, QuantizationMethod] = {}


def register_method(method: QuantizationMethod) -> QuantizationMethod:
    _METHODS[method.name] = method
    return method


def get_method(name: str) -> QuantizationMethod:
    if not _METHODS:
        from pagedllm.quantization import gguf  # noqa: F401  (registers itself)
    return _METHODS[name]


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """Float32 dense weight of any ``QuantizedWeight``, through its method."""
    return get_method(weight.method).dequantize(weight)


def _reference_prepare(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> torch.Tensor:
    return dequantize(weight).to(device=device, dtype=dtype)


def _reference_apply(dense: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.linear(x, dense, bias)


def reference_kernel(method: str = "") -> QuantizedLinearKernel:
    """Dequantize once at load into the model dtype, then a dense matmul: exact, but no memory saved."""
    return QuantizedLinearKernel(_reference_prepare, _reference_apply, name=f"reference({method})")
