"""The method interface, the registry of implemented methods, and the reference kernel every backend falls back to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
import torch.nn.functional as F

from pagedllm.backend.hookspec import QuantizedLinearKernel, QuantizedWeight


class QuantizationMethod(ABC):
    """One scheme: which weight types it keeps packed, and their exact dense meaning (the oracle of every kernel)."""

    name: str = ""

    @abstractmethod
    def weight_types(self) -> tuple[str, ...]:
        """The packed types this method's linear layers may hold (kernels are asked per type)."""

    @abstractmethod
    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        """The dense float32 ``[out_features, in_features]`` weight ``weight`` stands for."""

    def fuse(self, parts: list[QuantizedWeight]) -> Optional[QuantizedWeight]:
        """One weight for fused projections (q/k/v, gate/up: parts stacked along the output dim), or None when the
        parts cannot share one layout (the layer is then dequantized at load). Default: one tensor, rows = outputs."""
        if len({p.weight_type for p in parts}) != 1:
            return None
        return QuantizedWeight(parts[0].method, parts[0].weight_type, torch.cat([p.data for p in parts]),
                               (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    def reference_kernel(self, weight_type: str) -> QuantizedLinearKernel:
        """The oracle of every backend kernel for ``weight_type``. Default: dequantize at load, then a dense matmul
        (exact for weight-only schemes; W8A8 overrides it with its activation quantization)."""
        return QuantizedLinearKernel(_reference_prepare, _reference_apply, name=f"reference({self.name})")


_METHODS: dict[str, QuantizationMethod] = {}


def register_method(method: QuantizationMethod) -> QuantizationMethod:
    _METHODS[method.name] = method
    return method


def get_method(name: str) -> QuantizationMethod:
    if name not in _METHODS:  # each module registers itself on import
        # cycle: each of them imports register_method from here
        from pagedllm.quantization import awq, compressed_tensors, fp8, gguf, gptq  # noqa: F401
    return _METHODS[name]


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """Float32 dense weight of any ``QuantizedWeight``, through its method."""
    return get_method(weight.method).dequantize(weight)


def _reference_prepare(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> torch.Tensor:
    return dequantize(weight).to(device=device, dtype=dtype)


def _reference_apply(dense: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.linear(x, dense, bias)


def reference_kernel(method: str, weight_type: str = "") -> QuantizedLinearKernel:
    """Core's kernel for ``method`` / ``weight_type`` (weight-only schemes: dequantize once at load into the model
    dtype, then a dense matmul: exact, but no memory saved)."""
    return get_method(method).reference_kernel(weight_type)
