"""GrammarCompilePool: the server's grammar compile worker processes, with a time limit and cancellation.

Each compile runs on an idle worker (``compile_worker.py``); the event loop only awaits a future (the blocking pipe
round trip runs on a small thread pool, and a thread blocked on a pipe holds no GIL). A compile that runs past its
time limit, or whose client went away (the awaiting task is cancelled), is stopped by killing its worker, which is
replaced by a fresh fork of the pool's zygote (ready in milliseconds) while the other workers keep compiling. Compiled grammars are kept in an LRU cache
bounded by their serialized size, so a repeated schema costs nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from collections import OrderedDict
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, Optional, Sequence

from pagedllm.errors import ParamError
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import compile_worker
from pagedllm.structured_output.limits import StructuredOutputsConfig

logger = logging.getLogger(__name__)


_ZYGOTE_START_S = 300.0  # importing xgrammar and llguidance on a busy host


class CompileTimeout(Exception):
    """The grammar did not compile within its time limit; its worker was killed."""


class _WorkerGone(Exception):
    """The worker died mid-job (crash, OOM kill, killed for a cancelled job)."""


def _context() -> multiprocessing.context.BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("forkserver")  # the server's forkserver already imported transformers
    return multiprocessing.get_context("spawn")


class _Zygote:
    """The process every worker is forked from (``compile_worker.zygote_main``)."""

    def __init__(self, ctx, args: tuple):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=compile_worker.zygote_main, args=(child, *args), name="pagedllm-gzygote",
                                daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.lock = threading.Lock()

    def fork(self) -> "_Worker":
        """A new worker (runs on a pool thread: the first call waits for the zygote's imports)."""
        with self.lock:
            if not self.ready:
                if not self.conn.poll(_ZYGOTE_START_S):
                    raise _WorkerGone("grammar zygote did not start in time")
                if self.conn.recv()[0] != "ready":
                    raise _WorkerGone("grammar zygote failed to start")
                self.ready = True
            self.conn.send("fork")
            fd = reduction.recv_handle(self.conn)
            pid = self.conn.recv()
        w = _Worker(Connection(fd), pid)
        w.wait_ready(60.0)
        return w

    def stop(self) -> None:
        self.conn.close()
        # It holds nothing to flush, and one still importing its libraries would read the EOF only when done: a
        # server stopped soon after it started waited 2 s here.
        self.proc.terminate()
        self.proc.join(2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2)


class _Worker:
    def __init__(self, conn: Connection, pid: int):
        self.conn, self.pid = conn, pid
        self.retire = False

    def wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout) or self.conn.recv()[0] != "ready":
            raise _WorkerGone("grammar worker did not start")

    def roundtrip(self, spec: StructuredOutputsParams, timeout: float) -> tuple[str, Any]:
        """Send ``spec`` and wait for the reply (runs on a pool thread)."""
        try:
            self.conn.send(spec)
            if not self.conn.poll(timeout):
                raise CompileTimeout()
            kind, value, self.retire = self.conn.recv()
            return kind, value
        except (EOFError, OSError, TypeError, ValueError) as e:
            raise _WorkerGone(str(e)) from None

    def signal_kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal_kill()
        self.conn.close()


class GrammarCompilePool:
    """``config.compile_workers`` processes compiling grammars for ``tokenizer`` (the engine's vocabulary size and
    stop ids, so the engine can load what they compile). :meth:`start` it on the event loop that awaits
    :meth:`compile`; the workers come up in the background (the first compiles wait for them)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], backend: str,
                 config: StructuredOutputsConfig):
        self.config = config
        self._ctx = _context()
        self._args = (pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL), vocab_size, list(stop_token_ids),
                      backend, config.worker_memory_bytes)
        self._zygote = _Zygote(self._ctx, self._args)
        self._zygote_lock = threading.Lock()
        n = config.compile_workers
        self._workers: list[_Worker] = []
        self._threads = concurrent.futures.ThreadPoolExecutor(2 * n + 1, thread_name_prefix="pagedllm-grammar")
        self._idle: asyncio.Queue = asyncio.Queue()
        self._cache: OrderedDict[tuple, tuple[str, str]] = OrderedDict()
        self._cache_bytes = 0
        self._closed = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.restarts = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for _ in range(self.config.compile_workers):
            self._spawn()

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    async def compile(self, spec: StructuredOutputsParams, timeout: float,
                      queue_timeout: Optional[float] = None) -> tuple[str, str]:
        """(backend name, serialized compiled grammar) of ``spec``. Raises ParamError (the spec cannot compile: the
        client's fault), CompileTimeout (no compile within ``timeout`` seconds once a worker took it),
        asyncio.TimeoutError (no worker free within ``queue_timeout``), or CancelledError (the caller was
        cancelled: the compile is stopped)."""
        key = spec.key
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        w = await asyncio.wait_for(self._idle.get(), queue_timeout)
        healthy = False
        fut = self._threads.submit(w.roundtrip, spec, timeout)
        try:
            try:
                kind, value = await asyncio.wrap_future(fut)
            except asyncio.CancelledError:
                w.signal_kill()  # the client went away: stop its compile now
                raise
            except _WorkerGone:
                raise ParamError(f"structured_outputs.{spec.kind}", "cannot be compiled: the grammar compile worker "
                                                                    "crashed on it") from None
            healthy = not w.retire
        finally:
            if healthy:
                self._idle.put_nowait(w)
            else:
                fut.add_done_callback(lambda _: w.conn.close())  # once its round trip let go of the pipe
                self._replace(w)
        if kind != "ok":
            raise ParamError(*value)
        self._remember(key, value)
        return value

    def _remember(self, key: tuple, value: tuple[str, str]) -> None:
        size = len(value[1]) + len(key[1])
        if size > self.config.cache_bytes:
            return
        self._cache[key] = value
        self._cache_bytes += size
        while self._cache_bytes > self.config.cache_bytes:
            k, v = self._cache.popitem(last=False)
            self._cache_bytes -= len(v[1]) + len(k[1])

    def _replace(self, w: _Worker) -> None:
        """Kill ``w`` and fork its replacement off the event loop; the new worker joins the idle queue when up."""
        w.signal_kill()
        self._workers = [x for x in self._workers if x is not w]
        if not self._closed:
            self.restarts += 1
            self._spawn()

    def _spawn(self) -> None:
        if self._closed:
            return

        def fork() -> _Worker:
            z = self._zygote
            try:
                return z.fork()
            except (_WorkerGone, EOFError, OSError):  # the zygote died: start another (slow), then fork
                if self._closed:
                    raise
                with self._zygote_lock:
                    if self._zygote is z:
                        logger.error("grammar zygote gone; starting a new one")
                        self._zygote = _Zygote(self._ctx, self._args)
                        z.stop()
                return self._zygote.fork()

        def done(f: concurrent.futures.Future) -> None:
            if self._closed:
                if f.exception() is None:
                    f.result().kill()
                return
            if f.exception() is not None:  # could not start one: try again shortly rather than shrink the pool
                logger.error("grammar worker start failed: %s", f.exception())
                self._loop.call_soon_threadsafe(self._loop.call_later, 1.0, self._spawn)
                return
            self._loop.call_soon_threadsafe(self._add, f.result())

        self._threads.submit(fork).add_done_callback(done)

    def _add(self, w: _Worker) -> None:  # on the event loop, like every other change of ``_workers``
        if self._closed:
            w.kill()
            return
        self._workers.append(w)
        self._idle.put_nowait(w)

    def shutdown(self) -> None:
        self._closed = True
        for w in list(self._workers):
            w.kill()
        self._zygote.stop()
        self._threads.shutdown(wait=False, cancel_futures=True)
