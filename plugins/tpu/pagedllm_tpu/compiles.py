"""Counts XLA compilations in this process, so a test (or a log line) can prove none happen while serving.

JAX records ``/jax/core/compile/backend_compile_duration`` around every backend compile (``jax._src.dispatch.
BACKEND_COMPILE_EVENT``, emitted from ``pxla._cached_compilation``), a persistent-cache hit included, and
``/jax/compilation_cache/cache_hits`` when the persistent cache served it. tpu-inference's ``ForbidCompile``
(``tpu_inference/runner/utils.py``) guards the same thing by watching ``pxla._cached_lowering_to_hlo`` misses; a public
monitoring listener is the stabler hook.
"""

from __future__ import annotations

from collections import Counter

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_counts: Counter = Counter()
_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    from jax import monitoring

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            _counts["compiles"] += 1

    def on_event(event: str, **kwargs) -> None:
        if event == CACHE_HIT_EVENT:
            _counts["cache_hits"] += 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    _installed = True


def compiles() -> int:
    """XLA compilations since :func:`install` (persistent-cache hits included)."""
    return _counts["compiles"]


def cache_hits() -> int:
    return _counts["cache_hits"]
