"""pagedllm's cache folder, and the compiled ops a plugin builds there: one build at a time per machine, and whether
one is running.

A plugin that compiles kernels at first use (the CPU plugin's C++ ops) holds :func:`build_lock` while it builds, so
processes started together wait for one build instead of each starting its own (a fresh 2-core machine once ran three
at once, for four minutes, with every figure taken meanwhile at a tenth of the real speed). The lock is an
``flock`` on a file under ``cache_root()/builds``: the kernel releases it when its holder exits, however it exits, so
a killed build never leaves a lock behind. :func:`running` tells anyone (``pagedllm bench`` refuses to measure) that
a build holds it now; :data:`WAIT_ENV` asks plugins to build before the engine starts instead of in the background
(benchmarks set it, so they never time a fallback path).
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

WAIT_ENV = "PAGEDLLM_WAIT_FOR_BUILDS"


def cache_root() -> Path:
    """pagedllm's cache folder (``PAGEDLLM_CACHE``, else ``~/.cache/pagedllm``): compiled kernels, GGUF configs."""
    return Path(os.environ.get("PAGEDLLM_CACHE") or Path.home() / ".cache" / "pagedllm")


def _lock_dir() -> Path:
    return cache_root() / "builds"


@contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Hold the machine-wide build lock for ``name`` (blocks while another process holds it)."""
    d = _lock_dir()
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        os.close(fd)  # closing releases the flock


def running() -> list[str]:
    """Names whose build lock some process (this one included) holds now."""
    d = _lock_dir()
    busy = []
    for f in sorted(d.glob("*.lock")) if d.is_dir() else []:
        try:
            fd = os.open(f, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy.append(f.stem)
        finally:
            os.close(fd)
    return busy


def wait_requested() -> bool:
    """Whether plugins should finish building before the engine starts (``PAGEDLLM_WAIT_FOR_BUILDS=1``)."""
    return os.environ.get(WAIT_ENV, "") not in ("", "0", "false", "off")
