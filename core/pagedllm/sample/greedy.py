"""Greedy token choice (row-wise argmax over the vocabulary) in two cheap reductions instead of one slow one.

torch's CPU ``max(dim)`` / ``argmax`` carry an index through a scalar loop: 1.5-2.1 ms for 64 rows of a 32k-49k
vocabulary on 2 cores, more than a whole decode layer of a small model. A value-only ``amax`` is vectorised (~20x
faster), so: the maximum of each 128-wide block, the first block that holds the row maximum, then the argmax inside
that one block. The result is the first index of the row maximum, as ``argmax`` returns it (NaN counts as the
maximum in both)."""

from __future__ import annotations

import torch

_BLOCK = 128


def greedy_token_ids(logits: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` logits -> ``[N]`` int64 index of each row's first maximum (``logits.argmax(-1)``)."""
    n, vocab = logits.shape
    if vocab % _BLOCK or vocab < 4 * _BLOCK or logits.stride(-1) != 1:
        return logits.argmax(-1)
    blocks = logits.unflatten(-1, (-1, _BLOCK))
    best = blocks.amax(-1).argmax(-1)
    within = blocks[torch.arange(n, device=logits.device), best].argmax(-1)
    return best * _BLOCK + within
