"""Adapter residency: ``max_loras`` device slots of stacked, rank-padded A/B per layer and site, fed from an LRU of
``max_cpu_loras`` host copies, themselves re-read from disk when evicted.

Per fused site (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) a slot holds A ``[n_sub * R, in]`` and B
``[out, n_sub * R]`` with R = ``max_lora_rank``: sub-projection j (q/k/v, gate/up) owns rank columns
``[j*R, j*R + r)`` and its output rows, so B is block-diagonal and one shrink + one expand covers the fused linear.
Unused ranks and untargeted projections stay zero.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from pagedllm.lora.adapter import TARGETS, LoRAError, LoRAModel, load_adapter
from pagedllm.lora.request import LoRARequest

SITES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class LoRAStats:
    """Counters for /metrics and tests."""

    disk_loads: int = 0  # adapter folders read (first use, or re-read after host-LRU eviction)
    cpu_evictions: int = 0  # host copies dropped by the max_cpu_loras LRU
    slot_loads: int = 0  # copies of an adapter into a device slot (first use or swap)
    slot_evictions: int = 0  # adapters swapped out of a device slot to make room for another


class LoRAManager:
    def __init__(self, model: Any, max_loras: int, max_lora_rank: int, max_cpu_loras: int):
        self.model, self.max_loras, self.max_lora_rank = model, max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.known: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, LoRAModel] = OrderedDict()
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # resident adapter -> slot, least recently used first
        self.stats = LoRAStats()
        r, s, dev, dt = max_lora_rank, max_loras, model.device, model.dtype
        self.buffers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for layer in range(model.num_layers):
            bufs = {}
            for site in SITES:
                in_dim, outs = model.lora_site_split(layer, site)
                bufs[site] = (torch.zeros(s, len(outs) * r, in_dim, dtype=dt, device=dev),
                              torch.zeros(s, sum(outs), len(outs) * r, dtype=dt, device=dev))
            self.buffers.append(bufs)
        model.set_lora_buffers(self.buffers)

    # ---- registry --------------------------------------------------------------------------------
    def add(self, req: LoRARequest) -> None:
        """Register (and load once, so a bad folder fails now, naming its problem) an adapter."""
        old = self.known.get(req.lora_int_id)
        if old is not None:
            if (old.lora_name, old.lora_path) != (req.lora_name, req.lora_path):
                raise LoRAError("lora_request.lora_int_id", f"id {req.lora_int_id} is already adapter "
                                                            f"{old.lora_name!r} at {old.lora_path!r}")
            return
        model = self._load(req)
        self.known[req.lora_int_id] = req
        self._cache(model)

    def remove(self, lora_int_id: int) -> bool:
        if self.known.pop(lora_int_id, None) is None:
            return False
        self.host.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._zero(slot)
        return True

    def _load(self, req: LoRARequest) -> LoRAModel:
        model = load_adapter(req.lora_int_id, req.lora_name, req.lora_path, self.max_lora_rank, self.model)
        self.stats.disk_loads += 1
        return model

    def _cache(self, model: LoRAModel) -> None:
        self.host[model.lora_int_id] = model
        self.host.move_to_end(model.lora_int_id)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
            self.stats.cpu_evictions += 1

    def _host_copy(self, lora_int_id: int) -> LoRAModel:
        model = self.host.get(lora_int_id)
        if model is None:
            model = self._load(self.known[lora_int_id])
        self._cache(model)
        return model

    # ---- device slots ----------------------------------------------------------------------------
    def activate(self, ids: Iterable[int]) -> dict[int, int]:
        """Make every adapter in ``ids`` (at most ``max_loras`` distinct; the scheduler ensures it) resident and
        return adapter id -> slot. Least recently used adapters not in ``ids`` are swapped out for the missing."""
        want = list(dict.fromkeys(ids))
        if len(want) > self.max_loras:
            raise RuntimeError(f"a step uses {len(want)} adapters; max_loras is {self.max_loras}")
        for i in want:
            if i in self.slot_of:
                self.slot_of.move_to_end(i)
        for i in want:
            if i in self.slot_of:
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(v for v in self.slot_of if v not in want)
                slot = self.slot_of.pop(victim)
                self.stats.slot_evictions += 1
            self._write(slot, self._host_copy(i))
            self.slot_of[i] = slot
        return {i: self.slot_of[i] for i in want}

    def _zero(self, slot: int) -> None:
        for bufs in self.buffers:
            for a, b in bufs.values():
                a[slot].zero_()
                b[slot].zero_()

    def _write(self, slot: int, lora: LoRAModel) -> None:
        self._zero(slot)
        R = self.max_lora_rank
        for (layer, proj), (a, b) in lora.weights.items():
            site, sub = TARGETS[proj]
            A, B = self.buffers[layer][site]
            outs = self.model.lora_site_split(layer, site)[1]
            o = sum(outs[:sub])
            A[slot, sub * R: sub * R + lora.rank].copy_(a)
            B[slot, o: o + outs[sub], sub * R: sub * R + lora.rank].copy_(b)
        self.stats.slot_loads += 1
