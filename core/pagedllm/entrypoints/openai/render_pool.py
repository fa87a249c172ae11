"""RenderPool: the server's handle on its render worker processes (see ``render_worker.py`` for why processes).

Each job runs on an idle worker with a time limit; the event loop only awaits a future (the blocking pipe round
trip runs on a small thread pool of its own, and a thread blocked on a pipe holds no GIL). A worker that overruns
its limit, or dies, is killed and replaced by a fresh fork from the forkserver (which imported transformers once), so
the pool is back to full strength in well under a second while the other workers keep serving. A worker whose
resident memory grew past ``--render-worker-max-growth-mb`` (a huge tokenisation leaves the allocator holding it) is
recycled the same way after its job, so idle workers stay near their start size.

For a vision-language model the workers also hold its processor (``mm_processor``) and do a request's image work
(decode, processor, tensors into shared memory), so the engine loop only receives ready tensors. A worker killed
mid-job (timeout, crash) may have written segments nobody will read: they carry the job's tag, and are unlinked
with the worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import glob
import logging
import multiprocessing
import os
import pickle
import time
from multiprocessing.connection import Connection
from typing import Any, Optional

from pagedllm.entrypoints.openai import render_worker
from pagedllm.entrypoints.openai.render_worker import RenderError
from pagedllm.multimodal.shared_tensors import SEGMENT_PREFIX
from pagedllm.proc_mem import rss_bytes

logger = logging.getLogger(__name__)

DEFAULT_NUM_WORKERS = 2
DEFAULT_MEM_LIMIT = 1 << 30  # address space a worker may add on top of what it maps at start
# ... plus this when it processes images: an allowed 89-megapixel image is 268 MB as RGB and HF's processors make
# float32 copies of the resized pixels
MM_EXTRA_MEM_LIMIT = 3 << 30


class RenderTimeout(Exception):
    """A job ran past its time limit; its worker was killed."""


class _WorkerGone(Exception):
    """The worker died mid-job (crash, OOM kill)."""


_PRELOAD = ["__main__", "pagedllm.entrypoints.openai.render_worker"]
# A vision model's processor unpickles into transformers' processing modules (about 9 s of imports on a busy 2-core
# box): preloaded too when the server's model takes images, so a worker holding one starts in about a second.
_MM_PRELOAD = ["pagedllm.multimodal.processing", "transformers.processing_utils",
               "transformers.image_processing_utils"]


def _context(images: bool = False) -> multiprocessing.context.BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():  # Windows: slower respawns, same behaviour
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # A forked child re-runs the parent's main module (``pagedllm.cli`` under ``python -m``) before its target: with
    # that module's imports (torch among them) preloaded once in the forkserver, a respawn takes milliseconds.
    # (The list counts only when the forkserver starts: the first call decides.)
    ctx.set_forkserver_preload(_PRELOAD + (_MM_PRELOAD if images else []))
    return ctx


def warm_up_forkserver(images: bool = False) -> None:
    """Start the forkserver (it imports transformers, and its processing modules when the model takes ``images``)
    now, so it overlaps with the engine's model load."""
    if _context(images).get_start_method() == "forkserver":
        from multiprocessing import forkserver  # optional: POSIX-only (forkserver)

        forkserver.ensure_running()


class _Worker:
    def __init__(self, ctx, blob: bytes, mem_limit: Optional[int], cpus: Optional[frozenset[int]] = None,
                 max_growth: Optional[int] = None, mm_blob: Optional[bytes] = None):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=render_worker.main, args=(child, blob, mem_limit, mm_blob),
                                name="pagedllm-render", daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.pending_tag: Optional[str] = None  # the "mm" job in flight: its segments' tag
        self.max_growth, self.base_rss, self.grown = max_growth, None, False
        if cpus:
            set_affinity(self.proc.pid, cpus)

    def _wait_ready(self, timeout: float) -> None:
        if not self.ready:
            if not self.conn.poll(timeout):
                raise _WorkerGone("render worker did not start in time")
            kind, _ = self.conn.recv()
            if kind != "ready":
                raise _WorkerGone("render worker failed to start")
            self.ready = True
            self.base_rss = rss_bytes(self.proc.pid)

    def roundtrip(self, job: tuple, timeout: float) -> tuple[str, Any]:
        """Send ``job`` and wait for the reply (runs on a pool thread)."""
        conn: Connection = self.conn
        try:
            self._wait_ready(60.0)
            self.pending_tag = job[1] if job[0] == "mm" else None
            conn.send(job)
            if not conn.poll(timeout):
                raise RenderTimeout()
            reply = conn.recv()
            self.pending_tag = None  # its segments (if any) are the caller's now
            if self.max_growth is not None and self.base_rss is not None:
                rss = rss_bytes(self.proc.pid)
                self.grown = rss is not None and rss - self.base_rss > self.max_growth
            return reply
        except (EOFError, OSError) as e:
            raise _WorkerGone(str(e)) from None

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()
        if self.pending_tag is not None:
            release_segments(self.pending_tag)


def release_segments(tag: str) -> None:
    """Unlink the shared-memory segments of an "mm" job whose worker died before answering (Linux: /dev/shm)."""
    for path in glob.glob(f"/dev/shm/{SEGMENT_PREFIX}{tag}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def set_affinity(pid: int, cpus: frozenset[int]) -> None:
    """Keep a worker on the HTTP process's CPUs (``--engine-cpus``): renders never take the engine's cores."""
    try:
        os.sched_setaffinity(pid, cpus)
    except (AttributeError, OSError):  # no affinity API here, or the worker already exited
        pass


class RenderPool:
    """``num_workers`` render processes sharing one queue of idle workers."""

    def __init__(self, tokenizer: Any, num_workers: int = DEFAULT_NUM_WORKERS,
                 mem_limit_bytes: Optional[int] = DEFAULT_MEM_LIMIT, max_growth_bytes: Optional[int] = None,
                 mm_processor: Any = None):
        """``max_growth_bytes``: a worker whose resident memory grew more than this since it started is replaced
        after its job (allocators keep what a huge tokenisation took: one worker went from 60 to 398 MB).
        ``mm_processor``: a vision-language model's processor (``multimodal.processing.load_processor``): the
        workers then take "mm" jobs."""
        self._ctx = _context(images=mm_processor is not None)
        self._blob = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        self._mm_blob = (pickle.dumps(mm_processor, protocol=pickle.HIGHEST_PROTOCOL) if mm_processor is not None
                         else None)
        self.takes_images = mm_processor is not None
        if mem_limit_bytes and self.takes_images:
            mem_limit_bytes += MM_EXTRA_MEM_LIMIT
        self._mem = mem_limit_bytes
        self._growth = max_growth_bytes
        self.cpus: Optional[frozenset[int]] = None
        self.num_workers = max(int(num_workers), 1)
        self._workers = [self._new_worker() for _ in range(self.num_workers)]
        # Round trips plus respawns: never queued behind other blocking work on the loop's default executor.
        self._threads = concurrent.futures.ThreadPoolExecutor(2 * self.num_workers + 1,
                                                              thread_name_prefix="pagedllm-render")
        self._idle: Optional[asyncio.Queue] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._closed = False
        self.restarts = 0
        self.recycled = 0  # of the restarts: workers replaced for their memory growth

    def pin(self, cpus: frozenset[int]) -> None:
        """Run the workers (and every later respawn) on ``cpus`` only."""
        self.cpus = frozenset(cpus)
        for w in self._workers:
            set_affinity(w.proc.pid, self.cpus)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for w in self._workers:
            w._wait_ready(max(deadline - time.monotonic(), 0.1))

    @property
    def pids(self) -> list[Optional[int]]:
        return [w.proc.pid for w in self._workers]

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Queue()
        for w in self._workers:
            self._idle.put_nowait(w)

    async def run(self, job: tuple, timeout: float) -> Any:
        """The job's result; RenderError (the client's fault, 400) or RenderTimeout (also the request's fault), or
        the ParamError a job named a field with (an image: MediaError)."""
        if self._idle is None:
            await self.start()
        w = await self._idle.get()
        fut = self._loop.run_in_executor(self._threads, w.roundtrip, job, timeout)
        fut.add_done_callback(lambda f: self._after(w, f))
        try:
            kind, value = await asyncio.shield(fut)  # a cancelled request leaves the job to finish or time out
        except _WorkerGone:
            raise RenderError("the render worker crashed on this request") from None
        if kind == "exc":
            raise value
        if kind != "ok":
            raise RenderError(value)
        return value

    def _after(self, w: _Worker, f: asyncio.Future) -> None:
        if self._closed:
            return
        if f.cancelled() or (f.exception() is None and not w.grown):
            self._idle.put_nowait(w)
            return
        self.restarts += 1
        if f.exception() is None:
            self.recycled += 1
            logger.info("render worker %s grew past %d MiB over its start; recycling it", w.proc.pid,
                        self._growth >> 20)
        else:
            logger.warning("render worker %s %s; replacing it", w.proc.pid,
                           "ran past its time limit" if isinstance(f.exception(), RenderTimeout) else "died")
        respawn = self._loop.run_in_executor(self._threads, self._replace, w)
        respawn.add_done_callback(self._respawned)

    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, self._blob, self._mem, self.cpus, self._growth, self._mm_blob)

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        nw = self._new_worker()
        nw._wait_ready(60.0)
        self._workers = [nw if x is w else x for x in self._workers]
        return nw

    def _respawned(self, f: asyncio.Future) -> None:
        if self._closed:
            return
        if f.exception() is not None:  # could not fork: try again shortly rather than shrink the pool
            logger.error("render worker respawn failed: %s", f.exception())
            self._loop.call_later(1.0, self._retry_spawn)
            return
        self._idle.put_nowait(f.result())

    def _retry_spawn(self) -> None:
        respawn = self._loop.run_in_executor(self._threads, self._spawn_fresh)
        respawn.add_done_callback(self._respawned)

    def _spawn_fresh(self) -> _Worker:
        nw = self._new_worker()
        nw._wait_ready(60.0)
        self._workers.append(nw)
        return nw

    def shutdown(self) -> None:
        self._closed = True
        for w in list(self._workers):
            try:
                w.conn.close()  # the worker sees EOF and exits
            except OSError:
                pass
        for w in list(self._workers):
            w.proc.join(2)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(2)
        self._threads.shutdown(wait=False, cancel_futures=True)
