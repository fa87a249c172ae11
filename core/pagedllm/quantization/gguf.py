"""GGUF (llama.cpp) block-quantized weights, dequantized by the ``gguf`` package itself (the format's own oracle)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.quantization.base import QuantizationMethod, register_method

#: Packed types whose tensors stay quantized (every block type ``gguf.quants`` can dequantize).
DENSE_TYPES = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")


class GGUFMethod(QuantizationMethod):
    name = "gguf"

    def weight_types(self) -> tuple[str, ...]:
        import gguf  # heavy: gguf

        return tuple(t.name for t in gguf.GGMLQuantizationType if t.name not in DENSE_TYPES)

    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        import gguf  # heavy: gguf
        from gguf.quants import dequantize  # heavy: gguf

        qtype = gguf.GGMLQuantizationType[weight.weight_type]
        raw = weight.data.cpu().numpy() if isinstance(weight.data, torch.Tensor) else np.asarray(weight.data)
        dense = np.ascontiguousarray(dequantize(raw, qtype), dtype=np.float32)
        out = torch.from_numpy(dense)
        if tuple(out.shape) != tuple(weight.shape):
            raise ValueError(f"GGUF {weight.weight_type} weight dequantized to {tuple(out.shape)}, "
                             f"expected {weight.shape}")
        return out


GGUF = register_method(GGUFMethod())

#: K-quant super-block layouts (``gguf.quants`` dequantizes them but cannot quantize): bytes per 256 weights, the
#: byte offsets of their fp16 scales (d, then dmin where the type has one), and a d giving weights of std ~0.1.
_K_LAYOUT = {"Q4_K": (144, (0, 2), 4e-4), "Q5_K": (176, (0, 2), 2e-4), "Q6_K": (210, (208,), 1e-4)}


def random_blocks(weight_type: str, rows: int, cols: int, gen: np.random.Generator) -> np.ndarray:
    """Valid packed bytes ``[rows, bytes_per_row]`` of ``weight_type`` for tests and conformance: llama.cpp's own
    quantizer (``gguf.quants.quantize``) over normal weights, or for K-quants random nibbles, sub-scales and high
    bits under fp16 scales of a sensible size. Either way ``dequantize`` of these bytes is the oracle."""
    import gguf  # heavy: gguf
    from gguf.quants import quantize  # heavy: gguf

    if weight_type not in _K_LAYOUT:
        dense = (0.1 * gen.standard_normal((rows, cols))).astype(np.float32)
        return quantize(dense, gguf.GGMLQuantizationType[weight_type])
    size, offsets, mag = _K_LAYOUT[weight_type]
    raw = gen.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for off in offsets:
        scale = (mag * gen.uniform(0.5, 1.5, (rows, cols // 256, 1))).astype(np.float16)
        raw[..., off:off + 2] = scale.view(np.uint8)
    return raw.reshape(rows, -1)
