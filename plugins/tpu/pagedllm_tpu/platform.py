"""Where JAX runs: the TPU (default), or JAX's XLA CPU device when a test opts in. Nothing here imports jax at
module import time, so discovering the backend never pays jax's import or initialises a device runtime.

``PAGEDLLM_TPU_PLATFORM`` names the JAX platform the plugin drives: ``tpu`` (default) or ``cpu``. ``cpu`` is an
explicit opt-in for machines without a TPU: the very same jitted programs compile and run through XLA on the host
CPU. Results obtained that way are labelled "verified on XLA CPU, not verified on TPU hardware".

``PAGEDLLM_TPU_CACHE_DIR`` turns on XLA's persistent compilation cache in that folder (as tpu-inference's
``CompilationManager`` does with ``VLLM_XLA_CACHE_PATH``: ``jax.config.update("jax_compilation_cache_dir", ...)``,
vllm-project/tpu-inference ``tpu_inference/runner/compilation_manager.py``). On a TPU it defaults to
``~/.cache/pagedllm/xla``; ``PAGEDLLM_TPU_DISABLE_COMPILE_CACHE=1`` turns it off.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from typing import Any, Optional

PLATFORM_ENV = "PAGEDLLM_TPU_PLATFORM"
CACHE_DIR_ENV = "PAGEDLLM_TPU_CACHE_DIR"
DISABLE_CACHE_ENV = "PAGEDLLM_TPU_DISABLE_COMPILE_CACHE"
CPU_LABEL = "verified on XLA CPU, not verified on TPU hardware"


def requested_platform() -> str:
    """``tpu`` unless the user opted into JAX's CPU device."""
    return os.environ.get(PLATFORM_ENV, "tpu").strip().lower() or "tpu"


def jax_installed() -> bool:
    return importlib.util.find_spec("jax") is not None and importlib.util.find_spec("jaxlib") is not None


def probe() -> tuple[bool, str, str]:
    """(usable, reason, device name). Imports jax only when it is installed; never raises."""
    if not jax_installed():
        return False, "jax/jaxlib not installed (pip install 'pagedllm[tpu]'; on a TPU VM also 'jax[tpu]')", ""
    platform = requested_platform()
    if platform not in ("tpu", "cpu"):
        return False, f"{PLATFORM_ENV}={platform!r}: expected 'tpu' or 'cpu'", ""
    if platform == "tpu" and importlib.util.find_spec("libtpu") is None:
        # JAX reaches a TPU only through the libtpu plugin (jax[tpu]); without it there is nothing to find, and not
        # importing jax keeps `pagedllm backends` light (no XLA runtime threads in processes that fork later).
        return False, f"no TPU: libtpu is not installed, so jax {_version('jax')} sees only cpu", ""
    try:
        import jax

        seen = sorted({d.platform for d in jax.devices()})
    except Exception as e:  # a broken runtime is a reason, not a crash
        return False, f"jax failed to initialise: {type(e).__name__}: {e}", ""
    if platform == "tpu":
        try:
            tpus = jax.devices("tpu")
        except RuntimeError:
            tpus = []
        if not tpus:
            return False, f"no TPU: jax {jax.__version__} sees only {', '.join(seen)}", ""
        return True, "", f"{tpus[0].device_kind} x{len(tpus)}"
    cpus = jax.devices("cpu")
    return True, "", f"XLA CPU x{len(cpus)} (opt-in {PLATFORM_ENV}=cpu; {CPU_LABEL})"


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


@lru_cache(maxsize=1)
def device() -> Any:
    """The JAX device every array and program of this backend lives on (the first of the platform)."""
    import jax

    return jax.devices(requested_platform())[0]


def on_tpu() -> bool:
    return device().platform == "tpu"


def cache_dir() -> Optional[str]:
    if os.environ.get(DISABLE_CACHE_ENV, "") not in ("", "0"):
        return None
    path = os.environ.get(CACHE_DIR_ENV)
    if path:
        return path
    return os.path.expanduser("~/.cache/pagedllm/xla") if on_tpu() else None


def enable_compilation_cache() -> Optional[str]:
    """Point XLA's persistent compilation cache at :func:`cache_dir` (if any) and cache every program, however
    small or quick to compile (tpu-inference does the same under ``VLLM_XLA_CHECK_RECOMPILATION``)."""
    path = cache_dir()
    if path is None:
        return None
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return path


def memory_stats() -> tuple[int, int]:
    """(total, free) bytes of the device: HBM from ``Device.memory_stats()`` on a TPU (``bytes_limit`` /
    ``bytes_in_use``, as tpu-inference's ``utils.hbm_usage_bytes``), host RAM for XLA CPU."""
    stats = None
    try:
        stats = device().memory_stats()
    except Exception:
        stats = None
    if stats and "bytes_limit" in stats:
        total = int(stats["bytes_limit"])
        return total, max(0, total - int(stats.get("bytes_in_use", 0)))
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError):
        free = total // 2
    return int(total), int(min(free, total))
