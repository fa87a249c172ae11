"""What this process holds that an engine could leak: child processes, threads, shared memory, sockets.

The lifecycle tests take a census before an engine starts and after it shut down; ``leaks(before, after)`` lists
what is new. Read with psutil and ``/proc`` (Linux).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, fields

import psutil


@dataclass(frozen=True)
class Census:
    children: frozenset[str]  # "pid cmdline" of every descendant process (a zombie counts: it was not reaped)
    python_threads: frozenset[str]  # names of live Python threads
    os_threads: int  # threads of this process as the kernel counts them (gloo's, OpenMP's, Python's)
    shm: frozenset[str]  # files under /dev/shm this process maps, and pagedllm's files left in /dev/shm
    sockets: frozenset[str]  # this process's TCP sockets: "LISTEN 127.0.0.1:port", "ESTABLISHED a -> b"
    fds: int  # open file descriptors
    fd_targets: frozenset[str] = frozenset()  # "fd -> what it is", to name a leaked descriptor

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))


def _shm_maps() -> set[str]:
    out = set()
    with open(f"/proc/{os.getpid()}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                out.add("mapped " + parts[5].strip())
    return out


def _shm_files() -> set[str]:
    try:
        return {f"file /dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith("pagedllm")}
    except OSError:
        return set()


def take() -> Census:
    me = psutil.Process()
    kids = set()
    for c in me.children(recursive=True):
        try:
            kids.add(f"{c.pid} {c.status()} {' '.join(c.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            pass
    socks = set()
    for c in me.net_connections(kind="tcp"):
        addr = f"{c.laddr.ip}:{c.laddr.port}" if c.laddr else "?"
        socks.add(f"{c.status} {addr}" + (f" -> {c.raddr.ip}:{c.raddr.port}" if c.raddr else ""))
    return Census(children=frozenset(kids), python_threads=frozenset(t.name for t in threading.enumerate()),
                  os_threads=me.num_threads(), shm=frozenset(_shm_maps() | _shm_files()), sockets=frozenset(socks),
                  fds=me.num_fds(), fd_targets=frozenset(_fd_targets()))


def _fd_targets() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # the descriptor listdir itself used
            pass
    return out


def leaks(before: Census, after: Census) -> list[str]:
    """What ``after`` holds that ``before`` did not (more threads or descriptors count as a leak too)."""
    out = []
    for name in ("children", "python_threads", "shm", "sockets"):
        new = getattr(after, name) - getattr(before, name)
        if new:
            out.append(f"{name}: {sorted(new)}")
    if after.os_threads > before.os_threads:
        out.append(f"os_threads: {before.os_threads} -> {after.os_threads}")
    if after.fds > before.fds:
        out.append(f"fds: {before.fds} -> {after.fds} (new: {sorted(after.fd_targets - before.fd_targets)})")
    return out
