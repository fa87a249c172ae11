"""FP8 KV encode/decode in integer arithmetic, for caches passed to the kernels as bytes (``uint8`` views).

Why not ``x.to(tl.float8e4nv)``: Triton's CPU interpreter truncates float -> fp8 and can carry a rounding into the
wrong bit (measured: 1.9178 -> e5m2 gave 1.0, torch 2.0), and fp8e4nv needs sm_89+. These helpers match
``pagedllm.backend.kv_quant`` (torch's round-to-nearest-even after saturation) bit for bit everywhere, the interpreter
included. Formats: ``MANT`` mantissa bits and exponent ``BIAS`` (e4m3fn: 3, 7; e5m2: 2, 15).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: (mantissa bits, exponent bias, largest finite value) per torch fp8 dtype.
FORMATS = {torch.float8_e4m3fn: (3, 7, 448.0), torch.float8_e5m2: (2, 15, 57344.0)}


@triton.jit
def encode_fp8(x, inv_scale, MANT: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr):
    """float ``x * inv_scale`` saturated and rounded to nearest-even, as fp8 bits (int32 in [0, 255])."""
    y = x.to(tl.float32) * inv_scale
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.minimum(tl.abs(y), FMAX)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 1 - BIAS)  # subnormals share the min exp
    ulp = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)
    m = ((a / ulp + 8388608.0) - 8388608.0).to(tl.int32)  # a / ulp is exact; +-2^23 rounds to nearest-even
    carry = m >= (2 << MANT)
    e = tl.where(carry, e + 1, e)
    m = tl.where(carry, m >> 1, m)
    normal = m >= (1 << MANT)
    bits = tl.where(normal, ((e + BIAS) << MANT) | (m - (1 << MANT)), m)
    return bits | (sign << 7)


@triton.jit
def decode_fp8(bits, MANT: tl.constexpr, BIAS: tl.constexpr):
    """fp8 bits (any integer type) -> float32 (unscaled)."""
    b = bits.to(tl.int32) & 0xFF
    sign = (b >> 7) & 1
    ef = (b >> MANT) & ((1 << (7 - MANT)) - 1)
    m = b & ((1 << MANT) - 1)
    normal = ((sign << 31) | ((ef - BIAS + 127) << 23) | (m << (23 - MANT))).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * tl.full([], (1 - BIAS - MANT + 127) << 23, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(ef == 0, tl.where(sign == 1, -sub, sub), normal)
