"""GGUF (llama.cpp) block-quantized weights, dequantized by the ``gguf`` package itself (the format's own oracle)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.hookspec import QuantizedWeight
from pagedllm.quantization.base import QuantizationMethod, register_method

#: Packed types whose tensors stay quantized (every block type ``gguf.quants`` can dequantize).
DENSE_TYPES = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")


class GGUFMethod(QuantizationMethod):
    name = "gguf"

    def weight_types(self) -> tuple[str, ...]:
        import gguf

        return tuple(t.name for t in gguf.GGMLQuantizationType if t.name not in DENSE_TYPES)

    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        import gguf
        from gguf.quants import dequantize

        qtype = gguf.GGMLQuantizationType[weight.weight_type]
        raw = weight.data.cpu().numpy() if isinstance(weight.data, torch.Tensor) else np.asarray(weight.data)
        dense = np.ascontiguousarray(dequantize(raw, qtype), dtype=np.float32)
        out = torch.from_numpy(dense)
        if tuple(out.shape) != tuple(weight.shape):
            raise ValueError(f"GGUF {weight.weight_type} weight dequantized to {tuple(out.shape)}, "
                             f"expected {weight.shape}")
        return out


GGUF = register_method(GGUFMethod())
