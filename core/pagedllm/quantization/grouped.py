"""Grouped integer weights, the common meaning of GPTQ, AWQ and compressed-tensors' packed int4/int8 layouts.

Each of those formats packs integers differently on disk, but all mean ``W[n, k] = (q[n, k] - zero[g(k), n]) *
scale[g(k), n]`` with ``g(k) = g_idx[k]`` (contiguous groups unless GPTQ's ``desc_act`` permuted them). Their
readers unpack into :class:`GroupedInt`; its ``dense()`` is the reference every kernel is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class GroupedInt:
    """``q`` int32 ``[N, K]``; ``scales`` float32 ``[G, N]``; ``zeros`` float32 ``[G, N]`` in q units; ``g_idx``
    int64 ``[K]`` (group of each input column)."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int

    def dense(self) -> torch.Tensor:
        """Float32 ``[N, K]``."""
        s = self.scales.float().index_select(0, self.g_idx).t()
        z = self.zeros.float().index_select(0, self.g_idx).t()
        return (self.q.float() - z) * s

    def group_size(self) -> Optional[int]:
        """The group size when groups are contiguous and equal (the last one may be short), else None."""
        k, groups = self.q.shape[1], self.scales.shape[0]
        size = -(-k // groups)
        return size if torch.equal(self.g_idx, torch.arange(k) // size) else None


def contiguous_g_idx(k: int, group_size: int) -> torch.Tensor:
    """Group of each input column for contiguous groups (``group_size`` -1: one group, per channel)."""
    return torch.arange(k) // (k if group_size == -1 else group_size)


def unpack_cols(packed: torch.Tensor, bits: int, order: Optional[list[int]] = None) -> torch.Tensor:
    """int32 ``[R, C]`` holding ``32 / bits`` values per word, lowest bits first -> int32 ``[R, C * 32 / bits]``.
    ``order[i]`` is the column (within each word's span) that the i-th value holds (AWQ's interleaving)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    if order is not None:
        vals = vals[..., torch.tensor(order).argsort()]
    return vals.reshape(packed.shape[0], packed.shape[1] * per)


def pack_cols(values: torch.Tensor, bits: int, order: Optional[list[int]] = None) -> torch.Tensor:
    """Inverse of :func:`unpack_cols`, the last word zero-padded (test checkpoints and benches write the formats
    with it)."""
    per = 32 // bits
    values = torch.nn.functional.pad(values, (0, -values.shape[1] % per))
    rows, cols = values.shape
    vals = (values.to(torch.int64) & ((1 << bits) - 1)).reshape(rows, cols // per, per)
    if order is not None:
        vals = vals[..., torch.tensor(order)]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    word = (vals << shifts).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def round_to_nearest(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                     g_idx: Optional[torch.Tensor] = None) -> GroupedInt:
    """Round-to-nearest quantization of a float ``[N, K]`` weight (groups: ``g_idx``, default contiguous): the writer
    of the test checkpoints (GPTQ's and AWQ's own quantizers minimise a calibration loss; the on-disk meaning is the
    same). Asymmetric zero points are kept in 1..2**bits-1 so GPTQ v1 can store them."""
    n, k = w.shape
    g_idx = contiguous_g_idx(k, group_size) if g_idx is None else g_idx.long()
    groups = int(g_idx.max()) + 1
    qmax = (1 << bits) - 1
    wg = [w[:, g_idx == g].float() for g in range(groups)]
    if sym:
        scales = torch.stack([x.abs().amax(1) for x in wg]).clamp(min=1e-8) / (qmax / 2)
        zeros = torch.full_like(scales, float(1 << (bits - 1)))
    else:
        lo = torch.stack([x.amin(1) for x in wg]).clamp(max=0)
        hi = torch.stack([x.amax(1) for x in wg]).clamp(min=0)
        scales = ((hi - lo) / qmax).clamp(min=1e-8)
        zeros = (-lo / scales).round().clamp(1, qmax)
    scales = scales.half().float()  # the formats store fp16 scales
    q = (w.float() / scales[g_idx].t() + zeros[g_idx].t()).round().clamp(0, qmax).to(torch.int32)
    return GroupedInt(q, scales, zeros, g_idx, bits)
