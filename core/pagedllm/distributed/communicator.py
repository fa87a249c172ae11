"""Communicator: the collectives one parallel group runs (vLLM's ``DeviceCommunicatorBase``).

Core's reference is :class:`TorchCommunicator`: ``torch.distributed`` with the backend's collective library
(``pagedllm_distributed_backend``: gloo on CPU, the device's own library elsewhere). A backend specialises it
through the ``pagedllm_communicator`` hook (a shared-memory all-reduce on CPU, a device-native library), so core
never names a vendor collective. Every wait has a timeout: a dead or hung peer turns into :class:`CollectiveError`,
never a hang.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died (its connection closed) or did not answer within the timeout."""


class Communicator:
    """The collectives core needs, on the group ``ranks`` (global ranks; this process is one of them)."""

    def __init__(self, ranks: Sequence[int], device: torch.device, timeout_s: float):
        self.ranks = list(ranks)
        self.device = device
        self.timeout_s = timeout_s
        self.world_size = len(self.ranks)
        me = dist.get_rank() if dist.is_initialized() else 0
        self.rank_in_group = self.ranks.index(me) if me in self.ranks else -1  # -1: not a member

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place; returns it."""
        raise NotImplementedError

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``t`` (same shape on all ranks) along ``dim`` in rank order."""
        raise NotImplementedError

    def all_reduce_min(self, value: int) -> int:
        """The smallest of each rank's ``value`` (per-rank KV sizing: the smallest rank decides)."""
        return self._min(torch.tensor([value], dtype=torch.int64))

    def _min(self, t: torch.Tensor) -> int:
        raise NotImplementedError

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Send ``t`` to rank ``dst`` of this group (pipeline stages: hidden states, logits)."""
        raise NotImplementedError

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
        """Receive a tensor of ``shape``/``dtype`` from rank ``src`` of this group."""
        raise NotImplementedError

    def recv_async(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> Callable[[], torch.Tensor]:
        """Post a receive and return at once; calling the result waits for the tensor. Lets the pipeline's driver
        start its next batch while the last stage still works on this one. Default: receive now (no overlap)."""
        t = self.recv(shape, dtype, src)
        return lambda: t

    def wait_sends(self) -> None:
        """Wait for every send made so far (default: sends are synchronous, nothing to wait for)."""

    def detach_sends(self) -> Callable[[], None]:
        """The sends made so far, to be waited for later by calling the result (a stage need not wait for the next
        stage to take its hidden states before it runs its next batch)."""
        self.wait_sends()
        return lambda: None

    def barrier(self) -> None:
        raise NotImplementedError


class TorchCommunicator(Communicator):
    """Core's reference: a ``torch.distributed`` group on the backend's collective library (``collective``)."""

    def __init__(self, ranks: Sequence[int], device: torch.device, timeout_s: float, collective: str = "gloo"):
        super().__init__(ranks, device, timeout_s)
        self.collective = collective
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # new_group is itself collective: every rank of the world calls it for every group, in the same order.
        self.group = dist.new_group(self.ranks, backend=collective, timeout=self.timeout)
        self.send_works: list[Any] = []  # isend handles, waited on before their buffers may be reused
        self.wait_s, self.num_waits = 0.0, 0  # time this rank spent in collective waits (benchmarks)

    def _wait(self, work: Any, what: str) -> None:
        t0 = time.perf_counter()
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as e:  # gloo: a peer closed its socket / the library's own timeout
            raise CollectiveError(f"{what} on ranks {self.ranks} failed: {e}") from e
        self.wait_s += time.perf_counter() - t0
        self.num_waits += 1
        if ok is False:
            raise CollectiveError(f"{what} on ranks {self.ranks} did not complete in {self.timeout_s:g}s")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        self._wait(dist.all_reduce(t, group=self.group, async_op=True), "all_reduce")
        return t

    def _min(self, t: torch.Tensor) -> int:
        if self.world_size > 1:
            self._wait(dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, async_op=True), "all_reduce(min)")
        return int(t.item())

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._wait(dist.all_gather(parts, t, group=self.group, async_op=True), "all_gather")
        return torch.cat(parts, dim=dim)

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Asynchronous: the stage goes on with its next micro-batch while ``t`` travels."""
        t = t.contiguous()
        self.send_works.append((dist.isend(t, self.ranks[dst], group=self.group), t))

    def wait_sends(self) -> None:
        self.detach_sends()()

    def detach_sends(self) -> Callable[[], None]:
        works, self.send_works = self.send_works, []

        def wait() -> None:
            for w, _ in works:
                self._wait(w, "send")
        return wait

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
        return self.recv_async(shape, dtype, src)()

    def recv_async(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> Callable[[], torch.Tensor]:
        t = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        work = dist.irecv(t, self.ranks[src], group=self.group)

        def wait() -> torch.Tensor:
            self._wait(work, "recv")
            return t
        return wait

    def barrier(self) -> None:
        if self.world_size > 1:
            self._wait(dist.barrier(group=self.group, async_op=True), "barrier")


def init_world(rank: int, world_size: int, init_method: str, collective: str, timeout_s: float,
               device: Optional[torch.device] = None) -> None:
    """Join the world process group (every rank, before any group is made)."""
    if dist.is_initialized():
        return
    kw: dict[str, Any] = {}
    if device is not None and device.type != "cpu":
        kw["device_id"] = device
    dist.init_process_group(collective, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kw)
