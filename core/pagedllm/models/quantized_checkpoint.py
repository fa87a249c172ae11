"""A safetensors checkpoint whose linear weights are in a quantization method's packed tensors (GPTQ, AWQ,
compressed-tensors): ``quantized(name)`` hands the packed layout to ``quantize_linears``; ``take(name)`` of a packed
``*.weight`` dequantizes it (layers kept dense, and ``quantization='none'``)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.quantization.base import get_method


class QuantizedCheckpoint:
    def __init__(self, source: Any, quant_config: dict):
        self.source, self.config = source, quant_config
        self.method = get_method(quant_config["quant_method"])
        self._read: dict[str, Optional[QuantizedWeight]] = {}

    def quantized(self, name: str) -> Optional[QuantizedWeight]:
        """The packed weight of ``<module>.weight``, or None when that module is stored dense."""
        if not name.endswith(".weight"):
            return None
        module = name.removesuffix(".weight")
        if module not in self._read:
            self._read[module] = self.method.read(self.source, module, self.config)
        return self._read[module]

    def __contains__(self, name: str) -> bool:
        return name in self.source or self.quantized(name) is not None

    def names(self) -> set[str]:
        return set(self.source.names())

    def take(self, name: str) -> torch.Tensor:
        packed = self.quantized(name)
        if packed is None:
            return self.source.take(name)
        self._read[name.removesuffix(".weight")] = None  # taken once: drop the packed copy
        return self.method.dequantize(packed)
