"""AWQ checkpoints (``quant_method: awq``, ``version: gemm``, AutoAWQ's on-disk format).

Per linear ``m``: ``m.qweight`` int32 ``[K, N / 8]`` whose i-th nibble holds output column ``8 c + ORDER[i]``
(AutoAWQ's 0, 2, 4, 6, 1, 3, 5, 7 interleaving), ``m.qzeros`` int32 ``[G, N / 8]`` in the same order (absent or
ignored with ``zero_point: false``, which means a zero of 8), ``m.scales`` fp16 ``[G, N]``; groups are contiguous
along K. ``W[n, k] = scales[g, n] * (q[k, n] - zeros[g, n])`` with ``g = k // group_size``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.errors import UnsupportedModelError
from pagedllm.quantization.base import QuantizationMethod, register_method
from pagedllm.quantization.grouped import GroupedInt, contiguous_g_idx, pack_cols, unpack_cols

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


class AWQMethod(QuantizationMethod):
    name = "awq"

    def weight_types(self) -> tuple[str, ...]:
        return ("int4",)

    def check_config(self, qc: dict) -> None:
        bits, version = qc.get("bits", qc.get("w_bit")), str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise UnsupportedModelError(f"awq: bits={bits} version={version!r} is not supported (4-bit GEMM only)")

    def read(self, source: Any, module: str, qc: dict) -> Optional[QuantizedWeight]:
        if f"{module}.qweight" not in source:
            return None
        data = {t: source.take(f"{module}.{t}") for t in ("qweight", "scales")}
        k, n = data["qweight"].shape[0], data["scales"].shape[1]
        if qc.get("zero_point", True) and f"{module}.qzeros" in source:
            data["qzeros"] = source.take(f"{module}.qzeros")
        else:
            data["qzeros"] = pack_cols(torch.full(data["scales"].shape, 8, dtype=torch.int32), 4, ORDER)
        group = qc.get("group_size", qc.get("q_group_size", -1))
        data["g_idx"] = contiguous_g_idx(k, group).to(torch.int32)
        return QuantizedWeight("awq", "int4", data, (n, k))

    def fuse(self, parts: list[QuantizedWeight]) -> Optional[QuantizedWeight]:
        data = {t: torch.cat([p.data[t] for p in parts], dim=1) for t in ("qweight", "qzeros", "scales")}
        data["g_idx"] = parts[0].data["g_idx"]
        return QuantizedWeight("awq", "int4", data, (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    def unpack(self, weight: QuantizedWeight) -> GroupedInt:
        d, n = weight.data, weight.shape[0]
        q = unpack_cols(d["qweight"], 4, ORDER)[:, :n].t().contiguous()
        zeros = unpack_cols(d["qzeros"], 4, ORDER)[:, :n]
        return GroupedInt(q, d["scales"].float(), zeros.float(), d["g_idx"].long(), 4)

    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        return self.unpack(weight).dense()


AWQ = register_method(AWQMethod())


def write_awq(g: GroupedInt) -> dict[str, torch.Tensor]:
    """The GEMM on-disk tensors of ``g`` (contiguous groups)."""
    return {"qweight": pack_cols(g.q.t().contiguous(), 4, ORDER),
            "qzeros": pack_cols(g.zeros.to(torch.int32), 4, ORDER), "scales": g.scales.half()}
