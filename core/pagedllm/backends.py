"""Backend discovery (entry points), validation against the contract, and selection by ``--device``."""

from __future__ import annotations

import importlib.metadata as md
import traceback
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Optional

import pluggy
import torch

from pagedllm import hookspec, reference_plugin
from pagedllm.hookspec import (API_VERSION, ENTRY_POINT_GROUP, OP_HOOKS, PROJECT, REQUIRED_HOOKS, BackendInfo,
                               Capabilities, GraphRunner, KVCacheSpec, MemoryInfo, ProbeResult)


class BackendError(RuntimeError):
    """A backend is unknown, failed to load, breaks the contract, or is not usable here."""


class Backend:
    """One backend: its plugin plus core's reference fallbacks in a private PluginManager."""

    def __init__(self, plugin: Any, plugin_name: str):
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspec.BackendSpec)
        self.pm.register(reference_plugin, name="pagedllm-reference")
        self.pm.register(plugin, name=plugin_name)
        self.plugin = plugin
        own = {impl_name for impl_name in dir(plugin) if impl_name.startswith("pagedllm_")}
        missing = [h for h in REQUIRED_HOOKS if h not in own]
        if missing:
            raise BackendError(f"backend plugin {plugin_name!r} does not implement required hook(s): {missing}")
        self.pm.check_pending()
        self.info: BackendInfo = self.pm.hook.pagedllm_backend_info()
        if self.info.api_version not in (API_VERSION - 1, API_VERSION):
            raise BackendError(
                f"backend {self.info.name!r} was built for contract version {self.info.api_version}; "
                f"this pagedllm implements version {API_VERSION} (accepts {API_VERSION - 1}..{API_VERSION})")
        # Hot-path ops resolved once to plain functions (pluggy calls the last impl of a firstresult hook first).
        for name in OP_HOOKS:
            setattr(self, name.removeprefix("pagedllm_"), self._first_impl(name))

    def _first_impl(self, hook_name: str) -> Callable:
        return getattr(self.pm.hook, hook_name).get_hookimpls()[-1].function

    def implements(self, hook_name: str) -> bool:
        """True when the backend itself (not core's reference fallback) implements ``hook_name``."""
        return any(i.plugin is self.plugin for i in getattr(self.pm.hook, hook_name).get_hookimpls())

    # ---- typed wrappers -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.info.name

    @cached_property
    def probe(self) -> ProbeResult:
        try:
            return self.pm.hook.pagedllm_probe()
        except Exception as e:  # a probe must not raise; report instead
            return ProbeResult(False, f"probe raised {type(e).__name__}: {e}")

    @cached_property
    def capabilities(self) -> Capabilities:
        return self.pm.hook.pagedllm_capabilities()

    def device(self, index: Optional[int] = None) -> torch.device:
        return torch.device(self.info.device_type, index) if index is not None else torch.device(self.info.device_type)

    def memory_info(self, device: torch.device) -> MemoryInfo:
        return self.pm.hook.pagedllm_memory_info(device=device)

    def distributed_backend(self) -> str:
        return self.pm.hook.pagedllm_distributed_backend()

    def set_device(self, device: torch.device) -> None:
        self.pm.hook.pagedllm_set_device(device=device)

    def synchronize(self, device: torch.device) -> None:
        self.pm.hook.pagedllm_synchronize(device=device)

    def allocate_kv_cache(self, spec: KVCacheSpec) -> list:
        return self.pm.hook.pagedllm_allocate_kv_cache(spec=spec)

    def gather_kv_blocks(self, kv_cache: Any, block_ids: torch.Tensor) -> torch.Tensor:
        return self.pm.hook.pagedllm_gather_kv_blocks(kv_cache=kv_cache, block_ids=block_ids)

    def copy_kv_blocks(self, kv_caches: list, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.pm.hook.pagedllm_copy_kv_blocks(kv_caches=kv_caches, src=src, dst=dst)

    def swap_kv_blocks(self, src_caches: list, dst_caches: list, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.pm.hook.pagedllm_swap_kv_blocks(src_caches=src_caches, dst_caches=dst_caches, src=src, dst=dst)

    def graph_runner(self, model: Any, max_num_seqs: int, device: torch.device) -> GraphRunner:
        return self.pm.hook.pagedllm_graph_runner(model=model, max_num_seqs=max_num_seqs, device=device)

    def __repr__(self) -> str:
        return f"Backend({self.info.name!r}, device_type={self.info.device_type!r})"


@dataclass
class Discovered:
    """One entry point of the ``pagedllm.backends`` group: a loaded backend, or why it failed to load."""

    entry_name: str
    distribution: str
    backend: Optional[Backend] = None
    error: str = ""


_registry: dict[str, Discovered] | None = None


def discover(refresh: bool = False) -> dict[str, Discovered]:
    """Load every ``pagedllm.backends`` entry point. A plugin that fails to import is reported, not skipped."""
    global _registry
    if _registry is not None and not refresh:
        return _registry
    # Backends registered in-process (register_backend) survive a refresh; entry points are re-read.
    found: dict[str, Discovered] = {k: d for k, d in (_registry or {}).items() if d.distribution == "<registered>"}
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        item = Discovered(ep.name, dist)
        try:
            item.backend = Backend(ep.load(), ep.name)
        except Exception as e:
            item.error = f"{type(e).__name__}: {e}"
            item.error_traceback = traceback.format_exc()  # type: ignore[attr-defined]
        found[item.backend.name if item.backend else ep.name] = item
    _registry = found
    return found


def register_backend(plugin: Any, name: str) -> Backend:
    """Register a backend object directly (tests, notebooks); an entry point is the normal route."""
    backend = Backend(plugin, name)
    discover()[backend.name] = Discovered(name, "<registered>", backend)
    return backend


def known_extras() -> list[str]:
    """The backend extras our own distribution declares (so core names no vendor itself)."""
    try:
        extras = md.metadata("pagedllm").get_all("Provides-Extra") or []
    except md.PackageNotFoundError:
        return []
    return [e for e in extras if e not in ("serve", "dev")]


def get_backend(name: str = "auto") -> Backend:
    """Select a usable backend by name, or the highest-priority usable one for ``auto``."""
    found = discover()
    if name == "auto":
        usable = [d.backend for d in found.values() if d.backend is not None and d.backend.probe.usable]
        if not usable:
            raise BackendError("no usable backend installed; `pagedllm backends` says why. "
                               "Install one, e.g. `pip install pagedllm[cpu]`")
        return max(usable, key=lambda b: b.info.priority)
    item = found.get(name)
    if item is None:
        hint = (f"install it with `pip install pagedllm[{name}]`" if name in known_extras()
                else f"known backends: {sorted(found)}; installable extras: {known_extras()}")
        raise BackendError(f"device {name!r}: no backend named {name!r} is installed; {hint}")
    if item.backend is None:
        raise BackendError(f"device {name!r}: backend plugin from {item.distribution!r} failed to load: {item.error}")
    probe = item.backend.probe
    if not probe.usable:
        raise BackendError(f"device {name!r}: backend is installed but not usable here: {probe.reason}")
    return item.backend
