"""Reference LoRA op (the semantics of ``pagedllm_add_lora``) and the per-step token -> slot mapping it reads.

Punica/S-LoRA shape: each token picks its adapter's slot; ``shrink`` projects x onto the slot's A (rank space),
``expand`` maps back through B and adds into the base output. The reference groups tokens by slot (vLLM's sgmv
semantics; at most ``max_loras`` groups per step) so each group is two dense matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRAMapping:
    """One step's adapters: ``token_indices[t]`` is token t's slot (-1 = base model). Built on the host once per
    step so no layer recomputes it: ``perm`` lists the rows of adapter tokens sorted by slot and ``segments`` says
    which ``[start, end)`` of that order each slot owns; ``all_rows_slot`` is the slot when every token uses the same
    one (then no gather is needed at all)."""

    token_indices: torch.Tensor  # int64 [T]
    perm: torch.Tensor  # int64 [N]: rows with a slot >= 0, grouped by slot
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, start, end) into perm
    all_rows_slot: int = -1

    @property
    def num_slots_used(self) -> int:
        return len(self.segments)

    @classmethod
    def build(cls, slots_per_token: list[int], device: torch.device) -> "LoRAMapping":
        idx = torch.tensor(slots_per_token, dtype=torch.long)
        used = sorted(set(slots_per_token) - {-1})
        if len(used) == 1 and -1 not in slots_per_token:
            return cls(idx.to(device), idx.new_empty(0).to(device), [(used[0], 0, len(slots_per_token))], used[0])
        rows = [torch.nonzero(idx == s).flatten() for s in used]
        segments, start = [], 0
        for s, r in zip(used, rows):
            segments.append((s, start, start + len(r)))
            start += len(r)
        return cls(idx.to(device), torch.cat(rows).to(device), segments)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             mapping: LoRAMapping) -> None:
    """``y[t] += B[s] @ (A[s] @ x[t])`` for every token t with slot s = ``mapping.token_indices[t]`` >= 0, in place.

    ``y`` ``[T, out]``, ``x`` ``[T, in]``, ``lora_a`` ``[S, R, in]``, ``lora_b`` ``[S, out, R]`` (scaling folded into
    B; zero-padded ranks and block-diagonal fused sub-projections contribute nothing). One gather of the adapter
    rows, a shrink and an expand matmul per slot on contiguous slices, one scatter-add back."""
    if mapping.all_rows_slot >= 0:
        s = mapping.all_rows_slot
        y.add_((x @ lora_a[s].t()) @ lora_b[s].t())
        return
    xs = x.index_select(0, mapping.perm)
    delta = torch.cat([(xs[lo:hi] @ lora_a[s].t()) @ lora_b[s].t() for s, lo, hi in mapping.segments])
    y.index_add_(0, mapping.perm, delta.to(y.dtype))
