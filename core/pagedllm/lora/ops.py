"""Reference LoRA op (the semantics of ``pagedllm_add_lora``) and the per-step token -> slot mapping it reads.

Punica/S-LoRA shape: each token picks its adapter's slot; ``shrink`` projects x onto the slot's A (rank space),
``expand`` maps back through B and adds into the base output. The model runner orders each step's requests by
adapter, so a slot's tokens form a few contiguous runs and every run is two matmuls on slices, written in place:
no gather, no scatter, no delta the size of the output (vLLM's sgmv semantics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch


@dataclass
class LoRAMapping:
    """One step's adapters, built on the host once per step so no layer recomputes it.

    ``token_indices[t]`` is token t's slot (-1 = base model or padding); ``runs`` lists the maximal ranges of
    consecutive tokens sharing a slot >= 0 as ``(slot, start, end)``. ``uniform`` is set when the runs are adjacent
    and equally long (the common case: every adapter has as many decodes, or as many equal prompts, as the others),
    so a backend can view them as one ``[len(runs), run_len]`` grid and batch all adapters in one ``bmm`` each way:
    ``(start, run_len, slots)`` with ``slots`` the runs' slots, a ``slice`` when they are consecutive (the runner
    orders requests by slot, so usually: the slot stacks are then sliced, not gathered), else an int64 tensor."""

    token_indices: torch.Tensor  # int64 [T]
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    uniform: Optional[tuple[int, int, "slice | torch.Tensor"]] = None

    @property
    def num_slots_used(self) -> int:
        return len({s for s, _, _ in self.runs})

    @classmethod
    def build(cls, slots_per_token: "Sequence[int] | np.ndarray", device: torch.device) -> "LoRAMapping":
        idx = np.asarray(slots_per_token, dtype=np.int64)
        cut = np.flatnonzero(np.diff(idx)) + 1
        starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [len(idx)]])
        runs = [(int(idx[a]), int(a), int(b)) for a, b in zip(starts, ends) if idx[a] >= 0]
        uniform = None
        lens = {e - s for _, s, e in runs}
        if len(runs) > 1 and len(lens) == 1 and all(runs[i][2] == runs[i + 1][1] for i in range(len(runs) - 1)):
            slots = [r[0] for r in runs]
            consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
            uniform = (runs[0][1], lens.pop(), slice(slots[0], slots[0] + len(slots)) if consecutive
                       else torch.tensor(slots, device=device))
        return cls(torch.from_numpy(idx).to(device), runs, uniform)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             mapping: LoRAMapping) -> None:
    """``y[t] += B[s] @ (A[s] @ x[t])`` for every token t with slot s = ``mapping.token_indices[t]`` >= 0, in place.

    ``y`` ``[T, out]``, ``x`` ``[T, in]``, ``lora_a`` ``[S, R, in]``, ``lora_b`` ``[S, out, R]`` (scaling folded into
    B; zero-padded ranks and block-diagonal fused sub-projections contribute nothing). Per run of tokens sharing a
    slot: a shrink matmul and an expand accumulated into ``y``'s rows."""
    for s, lo, hi in mapping.runs:
        y[lo:hi].addmm_(x[lo:hi] @ lora_a[s].t(), lora_b[s].t())
