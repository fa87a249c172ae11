"""Tensor-parallel collectives through shared memory, for ranks on one host (vLLM's CPU backend has one too).

gloo moves every all-reduce through loopback TCP: tens of microseconds of system calls and copies for the few
kilobytes a decode step's row-parallel layer produces. Here the ranks of a group map one file in ``/dev/shm``: each
writes its tensor into its own slot, raises its flag to the collective's sequence number, waits for every other
flag, and reads the slots. A sum adds the slots in rank order on every rank, so all ranks get the same bits, and for
two ranks the same bits as gloo (``a + b == b + a``). Two sets of slots alternate, so a rank that runs ahead
writes into the set nobody still reads: to start collective n+2 it must have seen every flag of n+1, which each rank
raises only after it has read n.

Used only when every rank of the group is on this host, sees the file (``/dev/shm`` has room for its 2 x ranks x
8 MB, reserved at set-up), runs on x86-64 (its stores are not reordered with each other, nor loads with loads, so a
raised flag means the slot before it is written) and has not set ``PAGEDLLM_CPU_SHM_COMM=0``; all ranks decide
together at set-up. Tensors larger than a slot, and every other
collective (``send``/``recv``, barriers, the start-up minimum), stay on gloo. A wait checks that its peers are alive
(their pids, as zombies count as dead) and ends in :class:`CollectiveError` at the group's timeout, never a hang.
"""

from __future__ import annotations

import os
import platform
import socket
import tempfile
import time
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from pagedllm.backend import CollectiveError, TorchCommunicator

_ENV = "PAGEDLLM_CPU_SHM_COMM"
SLOT_BYTES = 8 << 20  # per rank and set; larger tensors (long prefill chunks) go through gloo
_HEADER = 4096  # flags and pids; slots start after it
_LINE = 8  # int64 per flag: one 64-byte cache line each, so ranks never write the same line
_SPIN = 2000  # tight checks before a wait starts yielding the CPU between checks
_ALIVE_EVERY_S = 0.05  # how often a wait checks that its peers still exist


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class ShmCommunicator(TorchCommunicator):
    """:class:`TorchCommunicator` whose ``all_reduce`` and ``all_gather`` go through a shared-memory file when the
    whole group is on this host (see the module docstring); everything else, and any tensor over
    :data:`SLOT_BYTES`, through gloo."""

    def __init__(self, ranks: Sequence[int], device: torch.device, timeout_s: float, collective: str = "gloo"):
        super().__init__(ranks, device, timeout_s, collective)
        self.seq = 0
        self.slots: Optional[torch.Tensor] = None  # uint8 [2, world_size, SLOT_BYTES]
        if self.world_size > 1 and self.rank_in_group >= 0:
            self._map()

    @property
    def uses_shm(self) -> bool:
        return self.slots is not None

    def _map(self) -> None:
        """Collective over the group: agree on using shared memory, then map one file that rank 0 creates."""
        ws = self.world_size
        want = os.environ.get(_ENV, "1") not in ("0", "false", "off") and platform.machine() in ("x86_64", "AMD64")
        votes: list = [None] * ws
        dist.all_gather_object(votes, (_host_id(), want), group=self.group)
        if not all(v[1] for v in votes) or len({v[0] for v in votes}) != 1:
            return
        size = _HEADER + 2 * ws * SLOT_BYTES
        path = [None]
        if self.rank_in_group == 0:
            try:
                fd, name = tempfile.mkstemp(prefix="pagedllm-tp-", dir="/dev/shm")
                try:  # reserve the pages now: a full /dev/shm (containers: 64 MB) fails here, not as SIGBUS later
                    os.posix_fallocate(fd, 0, size)
                    path = [name]
                except OSError:
                    os.unlink(name)
                finally:
                    os.close(fd)
            except OSError:
                pass
        dist.broadcast_object_list(path, src=self.ranks[0], group=self.group)
        mapped = None
        if path[0] is not None:
            try:
                mapped = torch.from_file(path[0], shared=True, size=size, dtype=torch.uint8)
            except (OSError, RuntimeError):
                mapped = None
        oks: list = [None] * ws
        dist.all_gather_object(oks, (mapped is not None, os.getpid()), group=self.group)
        self.barrier()  # every rank has mapped (or failed to): the name can go, the mappings stay
        if self.rank_in_group == 0 and path[0] is not None:
            os.unlink(path[0])
        if not all(ok for ok, _ in oks):
            return
        self.peer_pids = [pid for _, pid in oks]
        self.flags = mapped[: 2 * ws * _LINE * 8].view(torch.int64).view(2, ws, _LINE).numpy()
        self.slots = mapped[_HEADER:].view(2, ws, SLOT_BYTES)

    def _fits(self, t: torch.Tensor) -> bool:
        return self.slots is not None and t.numel() * t.element_size() <= SLOT_BYTES

    def _exchange(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Publish contiguous ``t`` in this rank's slot, wait for every rank's; the slots as ``t``-shaped views."""
        self.seq += 1
        seq, s = self.seq, self.seq & 1
        nbytes = t.numel() * t.element_size()
        self.slots[s, self.rank_in_group, :nbytes].copy_(t.reshape(-1).view(torch.uint8))
        self.flags[s, self.rank_in_group, 0] = seq
        t0 = time.perf_counter()
        for r in range(self.world_size):
            self._wait_flag(s, r, seq, t0, what)
        self.wait_s += time.perf_counter() - t0
        self.num_waits += 1
        return [self.slots[s, r, :nbytes].view(t.dtype).view(t.shape) for r in range(self.world_size)]

    def _wait_flag(self, s: int, r: int, seq: int, t0: float, what: str) -> None:
        flags = self.flags
        for _ in range(_SPIN):
            if flags[s, r, 0] >= seq:
                return
        checked = t0
        while flags[s, r, 0] < seq:
            time.sleep(0)
            now = time.perf_counter()
            if now - checked > _ALIVE_EVERY_S:
                checked = now
                if not _alive(self.peer_pids[r]):
                    raise CollectiveError(f"{what} on ranks {self.ranks}: rank {self.ranks[r]} "
                                          f"(pid {self.peer_pids[r]}) died")
                if now - t0 > self.timeout_s:
                    raise CollectiveError(f"{what} on ranks {self.ranks} did not complete in {self.timeout_s:g}s")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        if not (self._fits(t) and t.is_contiguous()):
            return super().all_reduce(t)
        parts = self._exchange(t, "all_reduce")
        t.copy_(parts[0])
        for p in parts[1:]:
            t.add_(p)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return t
        if not self._fits(t):
            return super().all_gather(t, dim)
        # cat copies out of the slots before they can be reused
        return torch.cat(self._exchange(t.contiguous(), "all_gather"), dim=dim)
