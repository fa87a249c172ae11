"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, llm-compressor's output).

Two formats of integer weights are read, per linear ``m``:

* ``pack-quantized`` (W4A16, W8A16): ``m.weight_packed`` int32 ``[N, ceil(K * bits / 32)]`` holding ``q + 2**(bits
  - 1)`` lowest bits first along K, ``m.weight_scale`` ``[N, G]``, ``m.weight_shape`` ``[N, K]`` and, when
  asymmetric, ``m.weight_zero_point`` packed the same way along N (``[ceil(N * bits / 32), G]``; unpacked at load:
  N * G values). ``W = (q - zero) * scale`` per group (``group``) or per row (``channel``).
* ``int-quantized`` (W8A8 / W8A16): ``m.weight`` int8 ``[N, K]``, ``m.weight_scale`` ``[N, 1]``. With dynamic
  per-token int8 ``input_activations`` in the config the layer is ``W8A8`` and runs
  :mod:`pagedllm.quantization.int8`'s math; otherwise weight-only ``W8A16``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.backend.hookspec import QuantizedLinearKernel, QuantizedWeight
from pagedllm.errors import UnsupportedModelError
from pagedllm.quantization.base import QuantizationMethod, register_method
from pagedllm.quantization.grouped import GroupedInt, contiguous_g_idx, unpack_cols
from pagedllm.quantization.int8 import W8A8_REFERENCE

FORMATS = ("pack-quantized", "int-quantized")


def _weights_args(qc: dict) -> list[dict]:
    return [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]


def _w8a8(qc: dict) -> bool:
    """Whether the config quantizes input activations to int8 dynamically per token."""
    for group in (qc.get("config_groups") or {}).values():
        act = group.get("input_activations") or {}
        if act and act.get("num_bits") == 8 and act.get("type", "int") == "int" and act.get("dynamic") and \
                act.get("strategy") == "token" and act.get("symmetric", True):
            return True
    return False


class CompressedTensorsMethod(QuantizationMethod):
    name = "compressed-tensors"

    def weight_types(self) -> tuple[str, ...]:
        return ("W4A16", "W8A16", "W8A8")

    def check_config(self, qc: dict) -> None:
        fmts = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()}
        bad = sorted(str(f) for f in fmts - {None, *FORMATS})
        for w in _weights_args(qc):
            if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8) or \
                    w.get("strategy") not in ("group", "channel"):
                bad.append(f"weights {w.get('type')}{w.get('num_bits')} {w.get('strategy')}")
        for group in (qc.get("config_groups") or {}).values():
            if group.get("input_activations") and not _w8a8({"config_groups": {"g": group}}):
                bad.append(f"input_activations {group['input_activations']}")
        if bad:
            raise UnsupportedModelError(f"compressed-tensors: {', '.join(bad)} not supported (supported: int4/int8 "
                                        f"weights per group or channel in {' / '.join(FORMATS)}, dynamic per-token "
                                        "int8 activations)")

    def read(self, source: Any, module: str, qc: dict) -> Optional[QuantizedWeight]:
        if f"{module}.weight_packed" in source:
            n, k = (int(v) for v in source.take(f"{module}.weight_shape"))
            packed = source.take(f"{module}.weight_packed")
            bits = 4 if packed.shape[1] == -(-k // 8) else 8  # words per row: ceil(K / 8) for 4 bits
            scale = source.take(f"{module}.weight_scale")
            if f"{module}.weight_zero_point" in source:
                zp = source.take(f"{module}.weight_zero_point")
                if zp.dtype == torch.int32:  # packed along N, values + 2**(bits-1) like q
                    zero = unpack_cols(zp.t().contiguous(), bits).t()[:n]
                else:
                    zero = zp.to(torch.int32) + (1 << (bits - 1))
            else:
                zero = torch.full(scale.shape, 1 << (bits - 1), dtype=torch.int32)
            return QuantizedWeight("compressed-tensors", f"W{bits}A16",
                                   {"weight_packed": packed, "weight_scale": scale, "zero": zero.to(torch.int32)},
                                   (n, k))
        if f"{module}.weight_scale" in source and f"{module}.weight" in source:
            w = source.take(f"{module}.weight")
            if w.dtype != torch.int8:
                raise ValueError(f"{module}.weight: int-quantized expects int8, got {w.dtype}")
            scale = source.take(f"{module}.weight_scale")
            zero = (source.take(f"{module}.weight_zero_point") if f"{module}.weight_zero_point" in source
                    else torch.zeros(scale.shape, dtype=torch.int32))
            return QuantizedWeight("compressed-tensors", "W8A8" if _w8a8(qc) else "W8A16",
                                   {"weight": w, "weight_scale": scale, "zero": zero.to(torch.int32)}, tuple(w.shape))
        return None

    def fuse(self, parts: list[QuantizedWeight]) -> Optional[QuantizedWeight]:
        keys = parts[0].data.keys()
        if len({p.weight_type for p in parts}) != 1 or len({p.data["weight_scale"].shape[1] for p in parts}) != 1:
            return None
        data = {t: torch.cat([p.data[t] for p in parts]) for t in keys}
        return QuantizedWeight(self.name, parts[0].weight_type, data, (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    def unpack(self, weight: QuantizedWeight) -> GroupedInt:
        d, (n, k) = weight.data, weight.shape
        if "weight_packed" in d:
            bits = int(weight.weight_type[1])
            q = unpack_cols(d["weight_packed"], bits)[:, :k]
        else:
            bits, q = 8, d["weight"].to(torch.int32)
        scales, zeros = d["weight_scale"].float().t().contiguous(), d["zero"].float().t().contiguous()
        g_idx = contiguous_g_idx(k, -1 if scales.shape[0] == 1 else -(-k // scales.shape[0]))
        return GroupedInt(q.contiguous(), scales, zeros, g_idx, bits)

    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        return self.unpack(weight).dense()

    def reference_kernel(self, weight_type: str) -> QuantizedLinearKernel:
        if weight_type == "W8A8":
            return W8A8_REFERENCE
        return super().reference_kernel(weight_type)


COMPRESSED_TENSORS = register_method(CompressedTensorsMethod())
