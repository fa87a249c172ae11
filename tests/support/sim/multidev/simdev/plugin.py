"""A pagedllm backend on the simulated ``simdev`` (tests only): required hooks, ``set_device``, and a communicator
that runs gloo on host copies. Every op falls back to core's reference on the wrapper tensors."""

from __future__ import annotations

from typing import Any, Sequence

import torch

import simdev
from pagedllm.distributed.communicator import TorchCommunicator
from pagedllm.backend.hookspec import BackendInfo, Capabilities, MemoryInfo, ProbeResult, hookimpl


@hookimpl
def pagedllm_backend_info() -> BackendInfo:
    return BackendInfo(name="simdev", device_type="simdev", priority=-100, description="simulated (tests)")


@hookimpl
def pagedllm_probe() -> ProbeResult:
    return ProbeResult(True, device_name=f"simdev x{simdev.COUNT} (simulated on CPU)")


@hookimpl
def pagedllm_capabilities() -> Capabilities:
    return Capabilities(sliding_window=True, soft_cap=True, mla=True)  # core's reference ops run every op


@hookimpl
def pagedllm_memory_info(device: torch.device) -> MemoryInfo:
    return MemoryInfo(total_bytes=8 << 30, free_bytes=4 << 30)


@hookimpl
def pagedllm_set_device(device: torch.device) -> None:
    torch.simdev.set_device(device)


class HostStagedCommunicator(TorchCommunicator):
    """gloo on host copies of the device tensors (a stand-in for a device collective library)."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        host = t.cpu()
        super().all_reduce(host)
        return t.copy_(host)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return super().all_gather(t.cpu(), dim).to(t.device)

    def send(self, t: torch.Tensor, dst: int) -> None:
        super().send(t.cpu(), dst)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=dtype)
        self._wait(torch.distributed.irecv(t, self.ranks[src], group=self.group), "recv")
        return t.to(self.device)


@hookimpl
def pagedllm_communicator(ranks: list[int], device: torch.device, collective: str, timeout_s: float) -> Any:
    return HostStagedCommunicator(ranks, device, timeout_s, "gloo")
