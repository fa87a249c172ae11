"""Backend discovery (entry points), validation against the contract, and selection by ``--device``."""

from __future__ import annotations

import importlib.metadata as md
import re
import traceback
import warnings
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Optional

import pluggy
import torch

from pagedllm.backend import hookspec, reference
from pagedllm.backend.hookspec import (API_VERSION, ENTRY_POINT_GROUP, HOOK_NAMES, PROJECT, REQUIRED_HOOKS,
                                       RETIRED_HOOK_NAMES, AttentionSpec, BackendInfo, Capabilities, GraphRunner,
                                       KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, MambaSpec, MemoryInfo,
                                       MLAAttentionSpec, ProbeResult, RunnerContext)
from pagedllm.errors import UserError


class BackendError(RuntimeError, UserError):
    """A backend is unknown, failed to load, breaks the contract, or is not usable here."""


class SwapUnsupported(BackendError):
    """The backend cannot hold swapped-out KV blocks on the host: core preempts by recompute instead."""


class Backend:
    """One backend: its plugin plus core's reference fallbacks in a private PluginManager.

    Every hook of :class:`~pagedllm.backend.hookspec.BackendSpec` becomes a method named without the ``pagedllm_`` prefix
    (``backend.write_kv(...)``, ``backend.update_config(...)``), bound once to exactly one implementation: the
    backend's own, else core's reference. Nothing falls through from one to the other, so an in-place hook returning
    ``None`` is never followed by the reference op on the backend's layout.
    """

    def __init__(self, plugin: Any, plugin_name: str):
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspec.BackendSpec)
        self.pm.add_hookspecs(hookspec.RetiredSpec)  # an older plugin implementing a retired hook still loads
        self.pm.register(reference, name="pagedllm-reference")
        self.pm.register(plugin, name=plugin_name)
        self.plugin = plugin
        own = {impl_name for impl_name in dir(plugin) if impl_name.startswith("pagedllm_")}
        missing = [h for h in REQUIRED_HOOKS if h not in own]
        if missing:
            raise BackendError(f"backend plugin {plugin_name!r} does not implement required hook(s): {missing}")
        self.pm.check_pending()
        retired = sorted(own.intersection(RETIRED_HOOK_NAMES))
        if retired:
            warnings.warn(f"backend plugin {plugin_name!r} implements retired hook(s) {retired}: core never calls "
                          "them (pagedllm.backend.hookspec.RetiredSpec); drop them", DeprecationWarning, stacklevel=2)
        for name in HOOK_NAMES:
            if name not in ("pagedllm_probe", "pagedllm_capabilities"):  # cached properties below
                setattr(self, name.removeprefix("pagedllm_"), self._resolve(name))
        self.allocate_kv_cache_groups = (self._checked_kv_cache_groups
                                         if self.implements("pagedllm_allocate_kv_cache_groups")
                                         else self._kv_cache_groups_from_allocators)  # a v3 plugin's caches
        if self.implements("pagedllm_allocate_kv_cache") and not self.implements("pagedllm_allocate_host_kv_cache"):
            self.allocate_host_kv_cache = self._own_layout_host_cache  # contract v1 had no host allocator
        self.info: BackendInfo = self.backend_info()
        if self.info.api_version not in (API_VERSION - 1, API_VERSION):
            raise BackendError(
                f"backend {self.info.name!r} was built for contract version {self.info.api_version}; "
                f"this pagedllm implements version {API_VERSION} (accepts {API_VERSION - 1}..{API_VERSION})")

    def _resolve(self, hook_name: str) -> Callable:
        """The one implementation of ``hook_name`` as a plain callable taking the spec's arguments (positional or by
        name). An implementation that names fewer arguments than the spec (pluggy allows it; a v1 plugin's
        ``pagedllm_graph_runner`` has no ``ctx``) gets only those."""
        caller = getattr(self.pm.hook, hook_name)
        impl = caller.get_hookimpls()[-1]  # pluggy calls the last-registered, non-trylast implementation first
        spec_args = tuple(caller.spec.argnames)
        if tuple(impl.argnames) == spec_args:
            return impl.function
        fn, wanted = impl.function, impl.argnames

        def call(*args: Any, **kwargs: Any) -> Any:
            kwargs.update(zip(spec_args, args))
            call_kwargs = {a: kwargs[a] for a in wanted}
            call_kwargs.update((a, kwargs[a]) for a in impl.kwargnames if a in kwargs)  # optional keywords
            return fn(**call_kwargs)

        return call

    def _own_layout_host_cache(self, spec: KVCacheSpec, pin_memory: bool) -> list:
        """Host caches for a backend with its own allocator but no ``pagedllm_allocate_host_kv_cache``: its own
        allocator asked for host memory, so its swap copies between caches of one layout. Raises
        :class:`SwapUnsupported` (core then preempts by recompute) where that cannot serve its swap."""
        def refuse(why: str) -> SwapUnsupported:
            return SwapUnsupported(f"swap not supported by backend {self.name!r}; preemption uses recompute ({why})")

        try:
            caches = self.allocate_kv_cache(spec)
        except Exception as e:
            raise refuse(f"its allocate_kv_cache failed for a host spec: {type(e).__name__}: {e}") from e
        tensors = [t for c in caches for t in _flat_tensors(c)]
        if not tensors or any(t.device.type != "cpu" for t in tensors):
            raise refuse("its allocate_kv_cache did not return torch tensors in host memory for a host spec")
        canonical = all(isinstance(c, torch.Tensor) and c.is_contiguous() and tuple(c.shape) == (
            1 if spec.mla else 2, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size) for c in caches)
        if not canonical and not self.implements("pagedllm_swap_kv_blocks"):
            raise refuse("it allocates its own KV layout and has no pagedllm_swap_kv_blocks; core's reference swap "
                         "indexes the canonical layout")
        if pin_memory:
            try:
                caches = [_pinned(c) for c in caches]
            except RuntimeError as e:  # no page-locking here: unpinned host memory still swaps
                warnings.warn(f"backend {self.name!r}: host KV caches left unpinned ({e})", RuntimeWarning)
        return caches

    def _kv_cache_groups_from_allocators(self, config: KVCacheConfig) -> dict:
        """The v3 path: the groups' caches from this backend's ``allocate_kv_cache`` / ``allocate_state_cache`` (its
        own or core's), called with exactly the specs core used before v4."""
        return reference.kv_cache_groups_from(config, self.allocate_kv_cache, self.allocate_state_cache)

    def _checked_kv_cache_groups(self, config: KVCacheConfig) -> dict:
        """The backend's ``pagedllm_allocate_kv_cache_groups``, its return checked per group and layer: a bad one
        is refused naming the backend and the group, before any step reads it."""
        caches = self._resolve("pagedllm_allocate_kv_cache_groups")(config)
        if not isinstance(caches, dict):
            raise BackendError(f"backend {self.name!r}: pagedllm_allocate_kv_cache_groups returned "
                               f"{type(caches).__name__}, not a dict of layer index -> cache")
        extra = sorted(set(caches) - set(config.layer_ids), key=str)
        if extra:
            raise BackendError(f"backend {self.name!r}: pagedllm_allocate_kv_cache_groups returned caches for "
                               f"layers {extra}, which are in no KV cache group")
        for g, group in enumerate(config.kv_cache_groups):
            for layer in group.layer_ids:
                why = self._cache_problem(group, caches.get(layer), config)
                if why:
                    raise BackendError(f"backend {self.name!r}: pagedllm_allocate_kv_cache_groups returned a bad "
                                       f"cache for layer {layer} of KV cache group {g} ({group.kind}, layers "
                                       f"{list(group.layer_ids)}): {why}")
        return caches

    def _cache_problem(self, group: KVCacheGroupSpec, cache: Any, config: KVCacheConfig) -> str:
        """Why ``cache`` cannot serve one layer of ``group`` ("" when it can)."""
        if cache is None:
            return "missing"
        spec, want = group.kv_cache_spec, torch.device(config.device)
        if isinstance(spec, MambaSpec):
            if (not isinstance(cache, (tuple, list)) or len(cache) != len(spec.shapes)
                    or not all(isinstance(t, torch.Tensor) for t in cache)):
                return f"want a tuple of {len(spec.shapes)} state tensors, got {_describe(cache)}"
            expected = [((spec.num_slots, *shape), dtype) for shape, dtype in zip(spec.shapes, spec.dtypes)]
        elif isinstance(spec, AttentionSpec):
            mla = isinstance(spec, MLAAttentionSpec)
            kernels = ("pagedllm_write_mla_kv", "pagedllm_mla_attention") if mla else (
                "pagedllm_write_kv", "pagedllm_paged_attention")
            if all(self.implements(h) for h in kernels):  # its own layout, read by its own kernels
                expected = [(None, spec.dtype)] * len(_flat_tensors(cache))
            else:  # core's reference kernels index the canonical layout
                if not isinstance(cache, torch.Tensor):
                    return (f"core's reference {' / '.join(h for h in kernels if not self.implements(h))} reads it: "
                            f"want a torch.Tensor, got {type(cache).__name__}")
                expected = [(spec.canonical_shape(config.num_blocks), spec.dtype)]
        else:
            return f"unknown spec {type(spec).__name__}"
        tensors = [cache] if isinstance(cache, torch.Tensor) else _flat_tensors(cache)
        for t, (shape, dtype) in zip(tensors, expected, strict=True):
            if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
                return f"on {t.device}, want {want}"
            if t.dtype != dtype:
                return f"dtype {t.dtype}, want {dtype}"
            if shape is not None and tuple(t.shape) != shape:
                return f"shape {tuple(t.shape)}, want {shape}"
        return ""

    def implements(self, hook_name: str) -> bool:
        """True when the backend itself (not core's reference fallback) implements ``hook_name``."""
        return any(i.plugin is self.plugin for i in getattr(self.pm.hook, hook_name).get_hookimpls())

    @property
    def name(self) -> str:
        return self.info.name

    @cached_property
    def probe(self) -> ProbeResult:
        try:
            return self._resolve("pagedllm_probe")()
        except Exception as e:  # a probe must not raise; report instead
            return ProbeResult(False, f"probe raised {type(e).__name__}: {e}")

    @cached_property
    def capabilities(self) -> Capabilities:
        """The backend's declared capabilities, plus what core's reference ops add where they run: ALiBi, attention
        sinks and bidirectional image spans whenever the attention is the reference's; for a backend without
        ``pagedllm_capabilities``, also the sliding window and soft cap of the reference attention and the reference
        MLA path on the canonical allocator."""
        caps = self._resolve("pagedllm_capabilities")()
        reference_attention = not self.implements("pagedllm_paged_attention")
        if reference_attention and not (caps.alibi and caps.attention_sinks and caps.mm_prefix_lm):
            # core's reference attention runs: it does all three
            caps = replace(caps, alibi=True, attention_sinks=True, mm_prefix_lm=True)
        if not self.implements("pagedllm_capabilities"):
            reference_mla = not any(self.implements(h) for h in ("pagedllm_write_mla_kv", "pagedllm_mla_attention",
                                                                 "pagedllm_allocate_kv_cache"))
            caps = replace(caps, sliding_window=reference_attention, soft_cap=reference_attention, mla=reference_mla)
        return caps

    def device(self, index: Optional[int] = None) -> torch.device:
        return torch.device(self.info.device_type, index) if index is not None else torch.device(self.info.device_type)

    def __repr__(self) -> str:
        return f"Backend({self.info.name!r}, device_type={self.info.device_type!r})"

    if TYPE_CHECKING:  # the generated methods, for type checkers and readers
        backend_info: Callable[[], BackendInfo]
        memory_info: Callable[[torch.device], MemoryInfo]
        memory_peak: Callable[[torch.device], Optional[int]]
        update_config: Callable[..., Optional[dict]]
        batch_policy: Callable[[RunnerContext], Any]
        model_runner: Callable[..., Any]
        distributed_backend: Callable[[], str]
        communicator: Callable[..., Any]
        set_device: Callable[[torch.device], None]
        synchronize: Callable[[torch.device], None]
        allocate_kv_cache: Callable[[KVCacheSpec], list]
        allocate_host_kv_cache: Callable[[KVCacheSpec, bool], list]
        allocate_state_cache: Callable[[Any], list]
        allocate_kv_cache_groups: Callable[[KVCacheConfig], dict]
        causal_conv1d_fn: Callable[..., torch.Tensor]
        causal_conv1d_update: Callable[..., torch.Tensor]
        write_kv: Callable[..., None]
        paged_attention: Callable[..., torch.Tensor]
        encoder_attention: Callable[..., torch.Tensor]
        write_mla_kv: Callable[..., None]
        mla_attention: Callable[..., torch.Tensor]
        gather_kv_blocks: Callable[[Any, torch.Tensor], torch.Tensor]
        swap_kv_blocks: Callable[[list, list, torch.Tensor, torch.Tensor], None]
        graph_runner: Callable[..., GraphRunner]
        rms_norm: Callable[..., torch.Tensor]
        fused_add_rms_norm: Callable[..., tuple]
        rotary: Callable[..., tuple]
        silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
        apply_token_bitmask: Callable[[torch.Tensor, torch.Tensor], None]
        add_lora: Callable[..., None]
        fused_moe: Callable[..., torch.Tensor]
        quantized_linear: Callable[[str, str], Any]


def _describe(obj: Any) -> str:
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__} of {[type(x).__name__ for x in obj]}"
    return type(obj).__name__


def _flat_tensors(obj: Any) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for x in obj for t in _flat_tensors(x)] if isinstance(obj, (list, tuple)) else []


def _pinned(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory()
    return type(obj)(_pinned(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


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
    """The backend extras our own distribution declares (so core names no vendor itself): those that install a
    ``pagedllm-<name>`` plugin, not ``bench``, ``ray``, ``serve`` or ``dev``."""
    try:
        requires = md.requires("pagedllm") or []
    except md.PackageNotFoundError:
        return []
    plugin = re.compile(r"pagedllm-[\w.-]+\s*;\s*extra\s*==\s*['\"]([\w.-]+)['\"]\s*$")
    return list(dict.fromkeys(m.group(1) for m in map(plugin.match, requires) if m))


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
