"""A child process that ends with its parent, however the parent ends (vLLM's ``PR_SET_PDEATHSIG`` and parent
watch in its engine-core and worker processes).

Pipe EOF alone is not enough: a rank blocked in a collective, loading weights or waiting in the rendezvous reads no
pipe, and a pipe end inherited by another child (a ``fork``) never reaches EOF. So a child calls
:func:`exit_with_parent` first thing. On Linux the kernel sends ``SIGKILL`` when the parent dies — but it watches the
parent *thread* that started the child, so that is asked for only when the parent started it from its main thread
(an engine started from a worker thread, as data-parallel replicas are, must outlive that thread). A daemon thread
also polls ``getppid()`` (a reparented child's parent changes), which covers those and every other platform.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
POLL_S = 0.25  # how often the watch thread checks its parent (one getppid system call)


def started_from_main_thread() -> bool:
    """What the parent passes to the child: may the child use the kernel's parent-death signal?"""
    return threading.current_thread() is threading.main_thread()


def exit_with_parent(parent_pid: int, death_signal: bool) -> None:
    """End this process (exit code 1) when ``parent_pid`` is no longer its parent. ``death_signal``: also ask the
    kernel for ``SIGKILL`` at the parent's death (only if the parent started this process from its main thread)."""
    if death_signal and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
                logger.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    threading.Thread(target=_watch, args=(parent_pid,), name="pagedllm-parent-watch", daemon=True).start()


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    try:
        sys.stderr.write(f"pagedllm: process {os.getpid()}: parent {parent_pid} died; exiting\n")
        sys.stderr.flush()
    finally:
        os._exit(1)
