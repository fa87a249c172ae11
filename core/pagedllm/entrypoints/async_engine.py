"""AsyncEngine: the (not thread-safe) LLMEngine owned by ONE background thread, fed by a command queue.

Every engine call (add, abort, step, get_stats) happens on that thread, so the asyncio event loop never blocks on a
model step. Outputs travel back in one ``loop.call_soon_threadsafe`` per step into per-request asyncio queues. Outputs
are cumulative, so a consumer that falls behind simply skips to the newest one (vLLM's output coalescing). The thread
sleeps on the command queue whenever no request is unfinished: no busy loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from typing import Any, Optional, Union

from pagedllm.config import EngineConfig
from pagedllm.engine import EngineStats, LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ACCEPTED = object()  # first queue item of a request the engine validated and queued


class EngineDeadError(RuntimeError):
    """The engine thread hit an unexpected error and stopped; the server reports 503 from then on."""


class RequestStream:
    """Async iterator over one request's (cumulative) outputs; closing it early aborts the request."""

    def __init__(self, engine: "AsyncEngine", request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.aborted = False  # closed by the server before the engine finished it
        self.last: Optional[RequestOutput] = None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        while not self.queue.empty():  # skip to the newest cumulative output
            if isinstance(item, BaseException) or item.finished:
                break
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.last = item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent, non-blocking)."""
        if not self.finished:
            self.finished = self.aborted = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    """``await add_request(...)`` validates and queues a request and returns its :class:`RequestStream`.

    Given an ``EngineConfig``, the engine thread also builds the engine (loads the model), so every torch op of the
    process runs on that one thread. This matters on CPU: GNU OpenMP keeps its workers spinning between parallel
    regions only while the process has no more OpenMP threads than cores; a second thread running torch ops (the
    event loop, had it loaded the model) creates a second team and drops both to sleeping waits, which made every
    decode step ~2x slower than the offline ``LLM`` on a quiet 2-core machine.
    """

    def __init__(self, engine: Union[LLMEngine, EngineConfig]):
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine-thread only
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.error: Optional[BaseException] = None
        self.num_steps = 0
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = threading.Thread(
            target=self._main, args=(engine,), name="pagedllm-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.error is not None:  # the engine could not be built: re-raise here (e.g. ParamError for a flag)
            self._thread.join()
            self._thread = None
            raise self.error
        self.tokenizer = self.engine.tokenizer
        self.max_model_len: int = self.engine.max_model_len
        self.model_path: str = self.engine.model_path
        self.vocab_size: int = self.engine.model.vocab_size

    # ---- lifecycle (event-loop side) -------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the running event loop that consumes outputs; call from inside it before the first request."""
        self._loop = asyncio.get_running_loop()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is left, stop the thread and wait for it (call after in-flight HTTP requests drained)."""
        if self._thread is None:
            return
        self._cmds.put(("stop",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.0fs", timeout)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self.error is None
                and self._loop is not None)

    # ---- requests (event-loop side) --------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: Optional[float] = None, priority: Optional[int] = None) -> RequestStream:
        """Queue a request; raises the engine's ParamError (or EngineDeadError) before any output exists."""
        if not self.is_running:
            raise EngineDeadError(f"engine is not running: {self.error!r}" if self.error else "engine is not running")
        stream = RequestStream(self, request_id)
        self._cmds.put(("add", stream, prompt, params, arrival_time, priority))
        if self.error is not None:  # died between the check and the put: answer the command ourselves
            self._fail_pending(EngineDeadError(f"engine error: {self.error!r}"))
        try:
            first = await stream.queue.get()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if isinstance(first, BaseException):
            stream.finished = True
            raise first
        assert first is _ACCEPTED
        return stream

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """The engine thread's latest stats snapshot (refreshed after every step and every command batch)."""
        return self._stats

    # ---- the engine thread -----------------------------------------------------------------------------------
    def _main(self, engine: Union[LLMEngine, EngineConfig]) -> None:
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else LLMEngine(engine)
            self._stats = dataclasses.replace(self.engine.get_stats())
        except BaseException as e:
            self.error = e
            return
        finally:
            self._ready.set()
        self._run()

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                busy = eng.has_unfinished_requests()
                try:
                    cmds = [self._cmds.get(block=not busy)]
                except queue.Empty:
                    cmds = []
                while True:
                    try:
                        cmds.append(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                batch: list[tuple[asyncio.Queue, Any]] = []
                stop = self._handle(cmds, batch)
                if stop:
                    self._abort_all(batch)
                    self._publish(batch)
                    return
                if eng.has_unfinished_requests():
                    outs = eng.step()
                    self.num_steps += 1
                    for out in outs:
                        stream = self._streams.get(out.request_id)
                        if stream is None:
                            continue
                        batch.append((stream.queue, out))
                        if out.finished:
                            del self._streams[out.request_id]
                self._publish(batch)
        except BaseException as e:  # a bug in the engine: fail every request, refuse new ones
            logger.exception("engine thread died")
            self.error = e
            dead = EngineDeadError(f"engine error: {type(e).__name__}: {e}")
            batch = [(s.queue, dead) for s in self._streams.values()]
            self._streams.clear()
            self._publish(batch, refresh=False)
            self._fail_pending(dead)

    def _handle(self, cmds: list, batch: list) -> bool:
        eng = self.engine
        stop = False
        for cmd in cmds:
            kind = cmd[0]
            if kind == "add":
                _, stream, prompt, params, arrival, priority = cmd
                try:
                    eng.add_request(stream.request_id, prompt, params, arrival_time=arrival, priority=priority)
                except Exception as e:  # ParamError and friends go back to that request only
                    batch.append((stream.queue, e))
                    continue
                self._streams[stream.request_id] = stream
                batch.append((stream.queue, _ACCEPTED))
            elif kind == "abort":
                rid = cmd[1]
                if self._streams.pop(rid, None) is not None:
                    eng.abort_request(rid)
            elif kind == "stop":
                stop = True
        return stop

    def _abort_all(self, batch: list) -> None:
        ids = list(self._streams)
        if ids:
            self.engine.abort_request(ids)
        err = EngineDeadError("engine shut down")
        batch.extend((s.queue, err) for s in self._streams.values())
        self._streams.clear()

    def _fail_pending(self, err: BaseException) -> None:
        """Answer commands queued after the engine died, so no caller waits forever."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._publish([(cmd[1].queue, err)], refresh=False)

    def _publish(self, batch: list, refresh: bool = True) -> None:
        # Stats first: a client that sees its final output and then scrapes /metrics sees a snapshot taken after
        # the step that finished it (blocks already freed).
        if refresh:
            self._stats = dataclasses.replace(self.engine.get_stats())
        if batch and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # loop closed under us during shutdown
                pass


def _deliver(batch: list) -> None:
    for q, item in batch:
        q.put_nowait(item)
