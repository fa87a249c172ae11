"""Multiprocessing executor: one worker process per rank 1..N-1 on this host, rank 0 in the engine process.

Each worker is a plain ``python -m pagedllm.executor`` child (started with ``subprocess``, so a daemonic
engine process may have them) holding one end of a socket pair. A step is pickled once and the same bytes are
written to every worker's socket (vLLM's shared-memory message queue is the faster version of this broadcast). A
worker whose driver process dies exits on its own, wherever it is blocked (``parent_watch.py``: the parent-death
signal and a parent watch; reading EOF too); a driver whose worker dies sees it in the next collective (gloo's
connection error, or the collective timeout) or before the next broadcast, and raises :class:`WorkerDiedError`.
``shutdown`` sends "stop", waits for every worker's exit (killing one that does not exit in time) and reaps it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import subprocess
import sys
import time
from multiprocessing.connection import wait
from typing import Optional

from pagedllm.executor.base import DistributedExecutor, WorkerDiedError, free_port
from pagedllm.executor.parent_watch import started_from_main_thread
from pagedllm.distributed.binding import rank_cpu_sets

logger = logging.getLogger(__name__)


class MultiprocExecutor(DistributedExecutor):
    name = "mp"
    failure_grace_s = 2.0

    def _start_ranks(self) -> tuple[str, Optional[frozenset[int]]]:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        cpus = rank_cpu_sets(self.world_size) if self.config.device in ("auto", "cpu") else [None] * self.world_size
        self.procs: list[subprocess.Popen] = []
        self.conns = []
        watch = [str(os.getpid()), "1" if started_from_main_thread() else "0"]
        for rank in range(1, self.world_size):
            mine, theirs = multiprocessing.Pipe(duplex=True)
            proc = subprocess.Popen([sys.executable, "-m", "pagedllm.executor", str(theirs.fileno()), *watch],
                                    pass_fds=(theirs.fileno(),))
            theirs.close()
            mine.send_bytes(pickle.dumps((rank, self.config, self.model_path, init_method, cpus[rank],
                                          logging.getLogger().getEffectiveLevel())))
            self.procs.append(proc)
            self.conns.append(mine)
        logger.info("mp executor: started ranks 1..%d (pids %s)", self.world_size - 1,
                    ", ".join(str(p.pid) for p in self.procs))
        return init_method, cpus[0]

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.distributed_timeout_s
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(0.1):
                if self.procs[rank - 1].poll() is not None or time.monotonic() > deadline:
                    raise WorkerDiedError(f"rank {rank} did not start: {self._dead_ranks() or 'timed out'}")
            kind, value = conn.recv()
            if kind == "error":
                raise value
        ready = wait(self.conns, timeout=0)  # nothing else is expected from the ranks
        if ready:
            raise WorkerDiedError("a rank sent an unexpected message after start")

    def _broadcast(self, payload: bytes) -> None:
        for conn in self.conns:
            conn.send_bytes(payload)

    def _dead_ranks(self) -> str:
        dead = [f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
                for r, p in enumerate(getattr(self, "procs", []), start=1) if p.poll() is not None]
        return "; ".join(dead)

    def _stop_ranks(self) -> None:
        for conn in getattr(self, "conns", []):
            try:
                conn.send_bytes(b"stop")
            except OSError:
                pass
            conn.close()
        deadline = time.monotonic() + self.stop_timeout_s  # one deadline for all: a stuck rank costs it once
        for rank, p in enumerate(getattr(self, "procs", []), start=1):
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("mp executor: rank %d (pid %d) did not stop within %.0fs; killing it", rank, p.pid,
                               self.stop_timeout_s)
                p.kill()
                p.wait()
