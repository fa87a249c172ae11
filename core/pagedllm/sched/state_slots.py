"""Recurrent-state slots: one per running request of a model with state (LFM2's conv state; Mamba2 / delta-rule
layers alike), the index into every state tensor of ``hookspec.MambaSpec``.

A request takes a slot when it is first scheduled, keeps it across its chunked-prefill chunks and decode steps, and
gives it back when it finishes, is aborted or is preempted. Preemption works both ways, as for K/V:

- by recompute: the request takes a slot again when it resumes and starts it fresh
  (``AttentionMetadata.has_initial_state`` is false while ``num_computed_tokens == 0``), so a slot is never cleared;
- by swap (``swap_space``): :class:`StateSwapSpace` gives the request a *host* slot beside its host blocks; the
  worker copies the device slot there before the step's model runs, and back into whatever device slot the request
  takes when it is swapped in (``SchedulerOutput.state_swap_out`` / ``state_swap_in``), so it resumes mid-sequence.

``n > 1`` samples and beam-search forks are separate requests that share no K/V blocks here (prefix caching is off
for models with state), so each computes its own state from its tokens: there is no state to fork or copy.
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


class StateSwapSpace:
    """Host slots for the recurrent state of swapped-out requests, paired with the device pool: a request preempted
    by swap moves its state ``device slot -> host slot`` and comes back into a (possibly different) free device
    slot. One host slot per swapped-out request; with none free the scheduler preempts by recompute."""

    def __init__(self, device: StateSlotPool, num_host_slots: int):
        self.device = device
        self.host = StateSlotPool(num_host_slots)

    def can_swap_out(self) -> bool:
        return self.host.num_free > 0

    def is_swapped(self, request_id: str) -> bool:
        return self.host.has_slot(request_id)

    def swap_out(self, request_id: str) -> tuple[int, int]:
        """(device slot, host slot) to copy before the device slot is given back (the caller frees it)."""
        return self.device.slot_of(request_id), self.host.take(request_id)

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """[(host slot, device slot)] for a swapped-out request, which takes a device slot now and gives its host
        slot back (its copy runs before this step's model, before any later swap-out can reuse it); [] when the
        request's state is not on the host."""
        if not self.host.has_slot(request_id):
            return []
        pair = (self.host.slot_of(request_id), self.device.take(request_id))
        self.host.free(request_id)
        return [pair]

    def release(self, request_id: str) -> None:
        """A swapped-out request finished or was aborted: its host slot goes back."""
        self.host.free(request_id)
