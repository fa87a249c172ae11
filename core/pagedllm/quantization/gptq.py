"""GPTQ checkpoints (``quant_method: gptq``, AutoGPTQ / GPTQModel "v1" on-disk format).

Per linear ``m``: ``m.qweight`` int32 ``[K * bits / 32, N]`` (values packed along K, lowest bits first),
``m.qzeros`` int32 ``[G, N * bits / 32]`` storing ``zero - 1`` (the v1 convention: a stored 7 is a zero point of 8;
a true zero of 0 cannot be stored and reads as 16 in 4 bits, a known quirk of the format that writers avoid),
``m.scales`` fp16 ``[G, N]`` and ``m.g_idx`` int32 ``[K]`` (the group of each input column; ``desc_act`` checkpoints
permute it). ``W[n, k] = scales[g, n] * (q[k, n] - (qzeros[g, n] + 1))`` with ``g = g_idx[k]``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.errors import UnsupportedModelError
from pagedllm.quantization.base import QuantizationMethod, register_method
from pagedllm.quantization.grouped import GroupedInt, contiguous_g_idx, pack_cols, unpack_cols

BITS = (4, 8)
TENSORS = ("qweight", "qzeros", "scales", "g_idx")


class GPTQMethod(QuantizationMethod):
    name = "gptq"

    def weight_types(self) -> tuple[str, ...]:
        return tuple(f"int{b}" for b in BITS)

    def check_config(self, qc: dict) -> None:
        if qc.get("bits") not in BITS:
            raise UnsupportedModelError(f"gptq: bits={qc.get('bits')} is not supported (supported: {BITS})")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise UnsupportedModelError(f"gptq: checkpoint_format={fmt!r} is not supported (only the v1 'gptq')")

    def read(self, source: Any, module: str, qc: dict) -> Optional[QuantizedWeight]:
        if f"{module}.qweight" not in source:
            return None
        bits = qc["bits"]
        data = {t: source.take(f"{module}.{t}") for t in TENSORS[:3]}
        k = data["qweight"].shape[0] * 32 // bits
        data["g_idx"] = (source.take(f"{module}.g_idx") if f"{module}.g_idx" in source
                         else contiguous_g_idx(k, qc.get("group_size", -1))).to(torch.int32)
        return QuantizedWeight("gptq", f"int{bits}", data, (data["scales"].shape[1], k))

    def fuse(self, parts: list[QuantizedWeight]) -> Optional[QuantizedWeight]:
        first = parts[0].data["g_idx"]
        if len({p.weight_type for p in parts}) != 1 or not all(torch.equal(p.data["g_idx"], first) for p in parts):
            return None  # desc_act parts permuted differently cannot share one packed layout
        data = {t: torch.cat([p.data[t] for p in parts], dim=1) for t in TENSORS[:3]}
        data["g_idx"] = first
        return QuantizedWeight("gptq", parts[0].weight_type, data, (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    def unpack(self, weight: QuantizedWeight) -> GroupedInt:
        bits = int(weight.weight_type.removeprefix("int"))
        d = weight.data
        q = unpack_cols(d["qweight"].t().contiguous(), bits)[:, : weight.shape[1]]  # packed along K -> [N, K]
        zeros = unpack_cols(d["qzeros"], bits)[:, : weight.shape[0]] + 1
        return GroupedInt(q.contiguous(), d["scales"].float(), zeros.float(), d["g_idx"].long(), bits)

    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        return self.unpack(weight).dense()


GPTQ = register_method(GPTQMethod())


def write_gptq(g: GroupedInt) -> dict[str, torch.Tensor]:
    """The v1 on-disk tensors of ``g`` (tests and benches write GPTQ checkpoints with it). Zero points must be
    1..2**bits-1 (v1 stores zero - 1)."""
    if bool((g.zeros < 1).any()):
        raise ValueError("GPTQ v1 cannot store a zero point of 0")
    return {"qweight": pack_cols(g.q, g.bits).t().contiguous(),
            "qzeros": pack_cols(g.zeros.to(torch.int32) - 1, g.bits),
            "scales": g.scales.half(), "g_idx": g.g_idx.to(torch.int32)}
