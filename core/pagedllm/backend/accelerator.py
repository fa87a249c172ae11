"""Runtime hooks shared by the GPU backends: every backend that drives its device through torch's device module for
its device type (``torch.get_device_module(device_type)``) and runs the portable Triton kernels (``triton/``).

One copy in core because plugins may not import each other, and the GPU plugins differ only in identity, probe,
collective library and a few capability flags. Nothing here names a device type, driver or collective library: a
plugin passes its own to :class:`DeviceHooks` (and its words for each probe step to :func:`probe_device`), then binds
the hooks in its plugin module. No vendor SDK is imported: everything goes through torch, and Triton loads on the
first kernel call. docs/architecture.md, "Device-generic GPU code", says why this lives here.
"""

from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import replace
from typing import Any, Callable

import torch

from pagedllm.backend.graph_runner import graph_class, make_graph_runner
from pagedllm.backend.hookspec import BackendInfo, Capabilities, GraphRunner, MemoryInfo, ProbeResult, hookimpl


def no_triton() -> str:
    """'' when the ``triton`` package is installed (it is not imported here), else why the kernels cannot run."""
    if importlib.util.find_spec("triton") is None:
        return "the Triton kernels need the `triton` package (pip install triton)"
    return ""


def driver_problem(vendor: str, library: str, visible_env: str) -> str:
    """Why the device module sees no device: the driver ``library`` does not load, or ``visible_env`` hides them."""
    try:
        ctypes.CDLL(library)
    except OSError:
        return f"no {vendor} driver: {library} cannot be loaded"
    return f"{vendor} driver found but no device is visible (check {visible_env})"


def probe_device(device_type: str, vendor: str, *, build_problem: Callable[[], str], unavailable: Callable[[], str],
                 device_problem: Callable[[Any, str], str] = lambda module, name: "",
                 triton_problem: Callable[[], str] = no_triton) -> ProbeResult:
    """The probe steps every GPU backend takes, most fundamental first; the plugin gives the words of each step.

    ``build_problem()``: why this torch build cannot drive the device ('' when it can); ``unavailable()``: why the
    device module reports no device; ``device_problem(module, name)``: why device 0 cannot run the kernels;
    ``triton_problem()``: why Triton cannot launch them. Never raises: a failure is reported as ``{vendor} probe
    failed``.
    """
    try:
        reason = build_problem()
        if reason:
            return ProbeResult(False, reason)
        module = torch.get_device_module(device_type)
        if not module.is_available():
            return ProbeResult(False, unavailable())
        name = module.get_device_name(0)
        reason = device_problem(module, name) or triton_problem()
        if reason:
            return ProbeResult(False, reason, name)
        return ProbeResult(True, "", f"{name} x{module.device_count()}")
    except Exception as e:  # a probe never raises
        return ProbeResult(False, f"{vendor} probe failed: {type(e).__name__}: {e}")


class DeviceHooks:
    """The hooks of one GPU backend but its op hooks (those come from ``pagedllm.backend.triton.hooks``).

    ``info`` is the backend's identity (its ``device_type`` picks the device module, looked up when a hook runs, so
    a module a vendor registers on import is found); ``probe`` its probe; ``distributed_backend`` its
    torch.distributed backend name; ``capabilities`` what its kernels support (bfloat16 is dropped when the device
    lacks it, decode graphs when they are off); ``graphs_off()`` says why the plugin turns decode graphs off, ''
    when it does not (they are also off when the device module has no graph class, or ``PAGEDLLM_DISABLE_GRAPHS=1``).

    The plugin module binds them with ``globals().update(hooks.hookimpls())``: pluggy finds a plugin's hook
    implementations among the module's attributes.
    """

    def __init__(self, info: BackendInfo, probe: Callable[[], ProbeResult], distributed_backend: str,
                 capabilities: Capabilities, graphs_off: Callable[[], str] = lambda: ""):
        self.info = info
        self._probe = probe
        self._distributed_backend = distributed_backend
        self._capabilities = capabilities
        self._graphs_off = graphs_off

    def hookimpls(self) -> dict[str, Callable[..., Any]]:
        """``{hook name: bound hook implementation}`` for the plugin module's namespace."""
        return {name: getattr(self, name) for name in dir(type(self)) if name.startswith("pagedllm_")}

    @property
    def module(self) -> Any:
        """torch's device module for ``info.device_type``."""
        return torch.get_device_module(self.info.device_type)

    def graphs_off_reason(self) -> str:
        """Why decode graphs are off for this backend, '' when they are on."""
        if graph_class(self.module, self.info.device_type) is None:
            return f"torch {torch.__version__} has no graph class for device type {self.info.device_type!r}"
        return self._graphs_off()

    @hookimpl
    def pagedllm_backend_info(self) -> BackendInfo:
        return self.info

    @hookimpl
    def pagedllm_probe(self) -> ProbeResult:
        return self._probe()

    @hookimpl
    def pagedllm_capabilities(self) -> Capabilities:
        caps, module = self._capabilities, self.module
        if module.is_available() and not module.is_bf16_supported():
            caps = replace(caps, dtypes=tuple(d for d in caps.dtypes if d != "bfloat16"))
        if self.graphs_off_reason():
            caps = replace(caps, graph_capture="none")
        return caps

    @hookimpl
    def pagedllm_memory_info(self, device: torch.device) -> MemoryInfo:
        free, total = self.module.mem_get_info(device)
        return MemoryInfo(total_bytes=int(total), free_bytes=int(free), pinned_host=True)

    @hookimpl
    def pagedllm_memory_peak(self, device: torch.device) -> int:
        module = self.module
        peak = module.max_memory_allocated(device)
        module.reset_peak_memory_stats(device)
        return int(peak)

    @hookimpl
    def pagedllm_distributed_backend(self) -> str:
        return self._distributed_backend

    @hookimpl
    def pagedllm_set_device(self, device: torch.device) -> None:
        self.module.set_device(device)

    @hookimpl
    def pagedllm_synchronize(self, device: torch.device) -> None:
        self.module.synchronize(device)

    @hookimpl
    def pagedllm_graph_runner(self, model: Any, max_num_seqs: int, device: torch.device, ctx: Any) -> GraphRunner:
        reason = self.graphs_off_reason()
        if reason:
            return GraphRunner(run=model, level="none", stats={"disabled_by": reason})
        module = self.module
        return make_graph_runner(model, max_num_seqs, device, ctx, api=module,
                                 graph_cls=graph_class(module, self.info.device_type))


__all__ = ["DeviceHooks", "probe_device", "driver_problem", "no_triton"]
