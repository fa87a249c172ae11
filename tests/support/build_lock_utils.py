"""A process holding a plugin's build lock (``pagedllm.backend.build_lock``), for tests of who waits and who refuses."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from pagedllm.backend import build_lock


def _hold(name: str, ready, release, then_write: str = "") -> None:
    with build_lock(name):
        ready.set()
        release.wait(60)
        if then_write:
            Path(then_write).write_bytes(b"built")


def holder(name: str, then_write: str = "") -> tuple:
    """A forked process that holds the lock until ``release`` is set (then writes ``then_write``, if given)."""
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(name, ready, release, then_write), daemon=True)
    p.start()
    assert ready.wait(30)
    return p, release
