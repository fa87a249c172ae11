"""Recurrent-state slots: one per running request of a model with state (LFM2's conv state; Mamba2 / delta-rule
layers alike), the index into every state tensor of ``hookspec.MambaSpec``.

A request takes a slot when it is first scheduled, keeps it across its chunked-prefill chunks and decode steps, and
gives it back when it finishes, is aborted or is preempted. Preemption is by recompute only (the engine keeps no
host copy of state): the request takes a slot again when it resumes, and starts it fresh
(``AttentionMetadata.has_initial_state`` is false while ``num_computed_tokens == 0``), so a slot is never cleared.
``n > 1`` samples are separate requests that share no K/V blocks here (prefix caching is off for models with state),
so each computes its own state from the prompt: there is nothing to fork.
"""

from __future__ import annotations


class StateSlotPool:
    """``num_slots`` slot ids, handed out lowest first (so a small batch touches few state pages)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots: a model with recurrent state needs at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: pop() gives the lowest
        self.owner: dict[str, int] = {}  # request id -> slot

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def slot_of(self, request_id: str) -> int:
        """The request's slot; KeyError when it holds none."""
        return self.owner[request_id]

    def has_slot(self, request_id: str) -> bool:
        return request_id in self.owner

    def take(self, request_id: str) -> int:
        """The request's slot, taking a free one on first use; RuntimeError when none is free (callers check
        ``num_free`` first: admission never starts more stateful requests than slots)."""
        slot = self.owner.get(request_id)
        if slot is not None:
            return slot
        if not self.free_slots:
            raise RuntimeError(f"no free state slot for request {request_id!r} ({self.num_slots} slots, all held)")
        slot = self.owner[request_id] = self.free_slots.pop()
        return slot

    def free(self, request_id: str) -> None:
        """Give the request's slot back (no-op when it holds none)."""
        slot = self.owner.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            self.free_slots.sort(reverse=True)
