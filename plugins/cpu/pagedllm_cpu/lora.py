"""Batched multi-LoRA for the CPU backend: all adapters of a step in two ``bmm`` calls per linear.

Core's reference runs two matmuls per run of tokens (16 per linear for 8 adapters: ~2,000 small calls per step over
30 layers), and on CPU their fixed cost, not their FLOPs, dominated a 64-request step. When the step's runs are
adjacent and equally long (``mapping.uniform``) they are viewed as a ``[adapters, run_len]`` grid with no copy: one
shrink ``bmm`` and one expand ``baddbmm`` written straight into the output rows. Other steps use the reference.
"""

from __future__ import annotations

import torch

from pagedllm.backend import add_lora_reference


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping) -> None:
    if mapping.uniform is None or not y.is_contiguous():
        add_lora_reference(y, x, lora_a, lora_b, mapping)
        return
    lo, n, slots = mapping.uniform
    if isinstance(slots, slice):  # consecutive slots: views of the stacks, no copy of B (3 MB for gate_up)
        a, b = lora_a[slots], lora_b[slots]
    else:
        a, b = lora_a.index_select(0, slots), lora_b.index_select(0, slots)
    s = a.shape[0]
    h = torch.bmm(x[lo:lo + s * n].reshape(s, n, x.shape[1]), a.transpose(1, 2))
    out = y[lo:lo + s * n].view(s, n, y.shape[1])
    out.baddbmm_(h, b.transpose(1, 2))
