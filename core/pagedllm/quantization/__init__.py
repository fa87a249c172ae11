"""Quantization: one method per scheme (vLLM's ``QuantizationConfig`` / ``LinearMethod`` split).

Core reads the checkpoint's scheme, keeps each linear weight in its packed layout (``QuantizedWeight``), and asks the
backend for a kernel through the one hook ``pagedllm_quantized_linear``; without one it runs the reference here
(dequantize, then matmul), which is also the conformance oracle. See docs/quantization.md.
"""

from __future__ import annotations

from pagedllm.quantization.base import QuantizationMethod, dequantize, get_method, reference_kernel
from pagedllm.quantization.config import IMPLEMENTED, QUANTIZATION_METHODS, resolve_quantization
from pagedllm.quantization.linear import QuantizedLinear, make_quantized_linear

__all__ = ["IMPLEMENTED", "QUANTIZATION_METHODS", "QuantizationMethod", "QuantizedLinear", "dequantize",
           "get_method", "make_quantized_linear", "reference_kernel", "resolve_quantization"]
