"""The host side of swap preemption for models with recurrent state (issue 28): how ``swap_space`` is split between
host K/V blocks and host state slots, the host state caches, and the slot copies.

A request preempted by swap takes its K/V blocks *and* its state slot to host memory (``sched/state_slots.py``
plans which slots); without the state its blocks would be useless, since the state after the computed tokens cannot
be rebuilt from K/V. State tensors keep the logical shape ``[num_slots, *shape]`` in every backend's layout
(``pagedllm_allocate_state_cache``), so core copies slots by indexing dimension 0, whatever the strides; the host
copies are contiguous (core's reference allocator on the CPU).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from pagedllm.backend.conv_ops import allocate_state_cache
from pagedllm.backend.hookspec import MambaSpec

logger = logging.getLogger(__name__)


def split_swap_space(swap_bytes: int, bytes_per_block: int, state: MambaSpec, blocks_per_seq: int) -> tuple[int, int]:
    """(host blocks, host state slots) for ``swap_bytes`` of host memory. Every swapped-out request needs one state
    slot beside its blocks: at most half the space goes to slots (at most one per device slot: more swapped-out
    requests than could ever run at once only wait longer), the rest to blocks. A model without attention layers
    (``bytes_per_block`` 0: pure Mamba2) spends it all on slots, with enough (free) blocks for each. (0, 0) when not
    even one slot fits: preemption then recomputes."""
    per_slot = state.bytes_per_slot
    share = swap_bytes // 2 if bytes_per_block else swap_bytes
    slots = min(state.num_slots, int(share // per_slot))
    if slots == 0:
        logger.warning("swap_space %.3f GiB holds no recurrent-state slot of %.1f KiB: preemption recomputes",
                       swap_bytes / 2**30, per_slot / 1024)
        return 0, 0
    blocks = int((swap_bytes - slots * per_slot) // bytes_per_block) if bytes_per_block else slots * blocks_per_seq
    return blocks, slots


def allocate_host_state_cache(spec: MambaSpec, num_slots: int) -> list:
    """Host copies of the state group: per layer, one contiguous ``[num_slots, *shape]`` CPU tensor per entry."""
    return allocate_state_cache(replace(spec, num_slots=num_slots, device=torch.device("cpu")))


def copy_state_slots(src: list, dst: list, pairs: list[tuple[int, int]]) -> None:
    """``dst[layer][i][d] = src[layer][i][s]`` for every ``(s, d)`` of ``pairs``, every layer and state entry (the
    device <-> host copy of swapped requests' state)."""
    s_ids, d_ids = (list(x) for x in zip(*pairs))
    for src_layer, dst_layer in zip(src, dst, strict=True):
        for s, d in zip(src_layer, dst_layer, strict=True):
            d[torch.tensor(d_ids, device=d.device)] = s[torch.tensor(s_ids, device=s.device)].to(d.device)
