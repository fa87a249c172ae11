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
    """One step's adapters: ``token_indices[t]`` is token t's slot (-1 = base model). ``groups`` lists each used
    slot with the rows of its tokens (host-built once per step so no layer recomputes it); ``all_rows_slot`` is
    the slot when every token uses the same one (rows can then be skipped)."""

    token_indices: torch.Tensor  # int64 [T]
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (slot, int64 rows)
    all_rows_slot: int = -1

    @classmethod
    def build(cls, slots_per_token: list[int], device: torch.device) -> "LoRAMapping":
        idx = torch.tensor(slots_per_token, dtype=torch.long)
        used = sorted(set(slots_per_token) - {-1})
        if len(used) == 1 and -1 not in slots_per_token:
            return cls(idx.to(device), [(used[0], idx.new_empty(0).to(device))], used[0])
        groups = [(s, torch.nonzero(idx == s).flatten().to(device)) for s in used]
        return cls(idx.to(device), groups)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             mapping: LoRAMapping) -> None:
    """``y[t] += B[s] @ (A[s] @ x[t])`` for every token t with slot s = ``mapping.token_indices[t]`` >= 0, in place.

    ``y`` ``[T, out]``, ``x`` ``[T, in]``, ``lora_a`` ``[S, R, in]``, ``lora_b`` ``[S, out, R]`` (scaling folded into
    B; zero-padded ranks and block-diagonal fused sub-projections contribute nothing)."""
    for slot, rows in mapping.groups:
        a, b = lora_a[slot], lora_b[slot]
        if mapping.all_rows_slot == slot:
            y.add_((x @ a.t()) @ b.t())
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
