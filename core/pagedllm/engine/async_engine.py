"""AsyncEngine: the server's handle on the engine process (see ``core_process.py`` for why it is a process).

``await add_request(...)`` sends the request and returns a :class:`RequestStream` once the engine accepted it (or
raises the engine's ParamError). Outputs come back one pipe message per engine step, read by the event loop itself
(asyncio pipe transports: no threads, so no GIL hand-offs) and routed to their requests' asyncio queues. Outputs are
cumulative, so a consumer that falls behind skips to the newest one (vLLM's output coalescing). Commands are written
through a non-blocking transport, so the event loop never waits on a full pipe while the engine is mid-step.

Lifecycle: ``shutdown()`` (idempotent) stops the engine process and closes both pipes, so a new AsyncEngine can be
started in the same process (the server's lifespan restarted); one dropped without it is stopped when it is garbage
collected or at interpreter exit. The engine process exits with this one however this one ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import struct
import weakref
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import EngineStats, PromptType
from pagedllm.engine.core_process import ACCEPTED, run_engine_core
from pagedllm.executor.parent_watch import started_from_main_thread
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.errors import ParamError
from pagedllm.sampling_params import SamplingParams
from pagedllm.models import load_tokenizer as load_tokenizer_, resolve_model_path

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine process stopped (a bug, a crash, or shutdown); the server reports 503 from then on."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its deadline (``--request-timeout``); it was aborted and its KV blocks freed."""


class RequestStream:
    """Async iterator over one request's (cumulative) outputs; closing it early aborts the request."""

    def __init__(self, engine: "AsyncEngine", request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.aborted = False  # closed by the server before the engine finished it
        self.last: Optional[RequestOutput] = None
        self.accumulate = False  # the engine sends deltas; rebuild the cumulative output in ``acc``
        self.acc: Optional[RequestOutput] = None
        self.released = -1  # output tokens at the last output handed to the consumer (stream interval)
        self.timer: Optional[asyncio.TimerHandle] = None  # the deadline, if any

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
    """Starts the engine process for ``config`` and waits until the model is loaded (build errors re-raise here).

    The tokenizer is loaded here too, for chat templates and /tokenize; the engine process tokenizes prompts and
    detokenizes outputs itself. ``stream_interval`` (vLLM's ``--stream-interval``): hand a request's consumer a new
    output only once it grew by that many tokens (the first token and the end always go at once); larger values
    trade streaming smoothness for less HTTP work per token. ``engine_cpus``: run the engine process on these CPUs
    only, one torch thread each (see ``cpu_split.py``).
    """

    def __init__(self, config: EngineConfig, stream_interval: int = 1,
                 engine_cpus: Optional[frozenset[int]] = None, lora_modules: Sequence[LoRARequest] = (),
                 load_tokenizer: bool = True, index: int = 0, dp_ep: Any = None,
                 on_spawn: Optional[Callable[[Any], None]] = None):
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ParamError("stream_interval", f"must be an integer >= 1, got {stream_interval!r}")
        self.stream_interval = stream_interval
        self.config = config
        #: This engine's number among data-parallel replicas (the ``engine`` label on /metrics); 0 alone.
        self.index = index
        #: Requests the engine accepted (its ``pagedllm:engine_requests`` counter).
        self.num_requests = 0
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold accelerator state
        self._conn, child_out = ctx.Pipe(duplex=False)  # engine -> server
        child_in, self._cmd_conn = ctx.Pipe(duplex=False)  # server -> engine
        self._proc = ctx.Process(target=run_engine_core, name=f"pagedllm-engine-{index}", daemon=True,
                                 args=(config, child_in, child_out, logging.getLogger().getEffectiveLevel(),
                                       engine_cpus, list(lora_modules), dp_ep,
                                       (os.getpid(), started_from_main_thread())))
        self._proc.start()
        self._pid = self._proc.pid
        # Dropped without shutdown(): stop the process when collected or at exit (refers to no part of self)
        self._finalizer = weakref.finalize(self, _stop_process, self._proc, self._cmd_conn, self._conn)
        if on_spawn is not None:  # the process, before its start-up is waited for (data parallel: to stop it early)
            on_spawn(self._proc)
        child_in.close()
        child_out.close()
        self._writer: Optional[asyncio.WriteTransport] = None
        self._reader: Optional[asyncio.ReadTransport] = None
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[str, asyncio.Future] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopping = False  # "stop" sent
        self._closed = False  # the process reaped, the pipes closed (or closing on the loop)
        self.error: Optional[BaseException] = None
        # Called once (on the event loop) when the engine process dies unexpectedly, after every in-flight request
        # got its error: ``pagedllm serve --exit-on-engine-failure`` exits the server from here.
        self.on_dead: Optional[Callable[[BaseException], None]] = None
        tok_error: Optional[BaseException] = None
        try:  # overlaps with the model load in the engine process
            self.tokenizer = (None if config.skip_tokenizer_init or not load_tokenizer
                              else load_tokenizer_(resolve_model_path(config.model)))
        except Exception as e:  # noqa: BLE001 - the engine's own error about the same model is more telling
            tok_error = e
        try:
            kind, info = self._conn.recv()
        except EOFError:
            kind, info = "error", EngineDeadError(f"engine process exited with code {self._proc.exitcode}")
        if kind != "ready" or tok_error is not None:
            if kind == "ready":  # the engine is up but the tokenizer is not: stop the engine
                self._cmd_conn.send(("stop",))
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
            self._finalizer()  # reaps it and closes the pipes
            raise info if kind != "ready" else tok_error
        self.max_model_len: int = info["max_model_len"]
        self.model_path: str = info["model_path"]
        self.vocab_size: int = info["vocab_size"]
        #: vLLM's supported tasks: ("generate",), or the pooling tasks of a pooling model (embed, classify, ...)
        self.supported_tasks: tuple[str, ...] = tuple(info.get("supported_tasks", ("generate",)))
        self._stats: EngineStats = info["stats"]
        #: The KV pool as built ({"block_size", "prefix_caching"}): data-parallel cache-aware routing keys on it.
        self.kv_cache: dict = info.get("kv_cache", {})
        #: DP+EP replicas: the experts this replica's model holds (``dp_lockstep.expert_info``); None otherwise.
        self.expert_parallel: Optional[dict] = info.get("expert_parallel")
        #: DP+EP: called with ``w`` when this replica starts lock-step wave ``w`` (the others must be woken).
        self.on_wave: Optional[Callable[[int], None]] = None
        #: Adapters clients may select by ``model=`` name (``--lora-modules`` and runtime loads).
        self.loras: dict[str, LoRARequest] = {r.lora_name: r for r in lora_modules}
        self._control_ids = itertools.count()
        self._lora_ids = itertools.count(max((r.lora_int_id for r in lora_modules), default=0) + 1)

    @property
    def pid(self) -> Optional[int]:
        return self._pid

    # ---- lifecycle (event-loop side) -------------------------------------------------------------------------
    async def start(self) -> None:
        """Attach both pipes to the running event loop (non-blocking transports: no thread, no GIL hand-offs)."""
        self._loop = asyncio.get_running_loop()
        # Each transport gets a duplicate descriptor of its own: uvloop closes the descriptor it watches when the
        # transport closes (asyncio's loop does not), and the pipes' own descriptors are closed once, by the
        # finalizer; sharing one number, the second close hit a descriptor the process had reused meanwhile.
        self._reader, _ = await self._loop.connect_read_pipe(
            lambda: _MessageReader(self._on_message, self._on_eof), os.fdopen(os.dup(self._conn.fileno()), "rb", 0))
        self._writer, _ = await self._loop.connect_write_pipe(
            asyncio.Protocol, os.fdopen(os.dup(self._cmd_conn.fileno()), "wb", 0))

    def begin_shutdown(self) -> None:
        """Abort whatever is left and tell the engine process to stop, without waiting (idempotent; a caller that
        stops several engines from the event loop's own thread sends every "stop" before it waits for any)."""
        if self._stopping:
            return
        self._stopping = True
        if self._writer is None or self._loop.is_closed():
            try:
                self._cmd_conn.send(("stop",))
            except OSError:  # already gone
                pass
        elif self._in_loop():
            self._send(("stop",))
        else:
            self._loop.call_soon_threadsafe(self._send, ("stop",))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is left, stop the engine process and close the pipes (call after in-flight HTTP requests
        drained; idempotent; from the event loop or another thread)."""
        self.begin_shutdown()
        if self._closed:
            return
        self._closed = True
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.warning("engine process did not stop within %.0fs; killing it", timeout)
            self._proc.kill()
            self._proc.join()
        # The event loop must forget the pipes' descriptors before they are closed (their numbers get reused), so
        # their transports close on the loop's own thread, then the pipes.
        loop = self._loop
        if loop is None or loop.is_closed() or self._in_loop() or not loop.is_running():
            self._close_pipes()
        else:
            loop.call_soon_threadsafe(self._close_pipes)

    def _in_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _close_pipes(self) -> None:
        if self._loop is not None and not self._loop.is_closed():  # (a closed loop watches nothing any more)
            for t in (self._writer, self._reader):
                if t is not None:
                    t.close()
        self._writer = self._reader = None
        self._finalizer()  # the process is reaped: this closes both pipes

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._stopping and self.error is None

    # ---- requests (event-loop side) --------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: Optional[float] = None, priority: Optional[int] = None,
                          timeout: Optional[float] = None, lora_request: Optional[LoRARequest] = None
                          ) -> RequestStream:
        """Queue a request; raises the engine's ParamError (or EngineDeadError) before any output exists.

        ``timeout`` (seconds from now): past it the request is aborted in the engine (its blocks freed) and its
        consumer gets :class:`RequestTimeoutError`.
        """
        if not self.is_running:
            raise EngineDeadError(f"engine is not running: {self.error!r}" if self.error else "engine is not running")
        if self.has_request(request_id):
            raise ParamError("request_id", f"{request_id!r} is already in use")
        stream = RequestStream(self, request_id)
        if getattr(params, "output_kind", None) == "cumulative":  # (PoolingParams: one final output, no deltas)  # the pipe carries deltas; _route accumulates them here
            params = params.clone(output_kind="delta")
            stream.accumulate = True
        accepted = self._loop.create_future()
        self._pending[request_id] = accepted
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt, params, arrival_time, priority, lora_request))
        if timeout is not None:
            stream.timer = self._loop.call_later(max(timeout, 0.0), self._expire, request_id, timeout)
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            stream.finished = True
            if stream.timer is not None:
                stream.timer.cancel()
            raise
        self.num_requests += 1
        return stream

    def encode(self, prompt: PromptType, pooling_params: PoolingParams, request_id: str,
               lora_request: Optional[LoRARequest] = None, priority: int = 0, timeout: Optional[float] = None,
               arrival_time: Optional[float] = None) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's ``AsyncLLM.encode``: an async generator yielding the request's final
        :class:`~pagedllm.outputs.PoolingRequestOutput` (the engine's ParamError raises at the first ``anext``).
        Cancelling or closing it before the output aborts the request in the engine (its blocks freed)."""
        return encode_stream(self.add_request, prompt, pooling_params, request_id, lora_request, priority, timeout,
                             arrival_time)

    def num_unfinished(self) -> int:
        """Requests this engine holds (added and not finished or aborted): its load for data-parallel balancing."""
        return len(self._streams)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams or request_id in self._pending

    async def _control(self, kind: str, arg: Any) -> None:
        """Run one engine command answered like an add (accepted, or the engine's exception re-raised here)."""
        if not self.is_running:
            raise EngineDeadError(f"engine is not running: {self.error!r}" if self.error else "engine is not running")
        rid = f"__{kind}-{next(self._control_ids)}"
        done = self._loop.create_future()
        self._pending[rid] = done
        self._send((kind, rid, arg))
        await done

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter in the engine (checked there: a bad folder raises its ParamError) and serve its name."""
        if lora_request.lora_name in self.loras:
            raise ParamError("lora_name", f"an adapter named {lora_request.lora_name!r} is already loaded")
        await self._control("add_lora", lora_request)
        self.loras[lora_request.lora_name] = lora_request

    async def remove_lora(self, lora_name: str) -> None:
        lora = self.loras.get(lora_name)
        if lora is None:
            raise ParamError("lora_name", f"no adapter named {lora_name!r} is loaded")
        await self._control("remove_lora", lora.lora_int_id)
        del self.loras[lora_name]

    def next_lora_id(self) -> int:
        """A fresh adapter id (never reused, so no prefix-cache block of an unloaded adapter can match)."""
        return next(self._lora_ids)

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            if stream.timer is not None:
                stream.timer.cancel()
            if not self._stopping:
                self._send(("abort", request_id))

    def _expire(self, request_id: str, timeout: float) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        err = RequestTimeoutError(f"the request ran past its deadline of {timeout:g} s (--request-timeout) and was "
                                  "aborted")
        fut = self._pending.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(err)
        stream.queue.put_nowait(err)
        self.abort(request_id)

    def stats(self) -> EngineStats:
        """The engine's stats snapshot as of its latest step or command."""
        return self._stats

    def replica_stats(self) -> list[tuple[EngineStats, int]]:
        """(stats, requests accepted) per engine replica, for /metrics: this one engine."""
        return [(self._stats, self.num_requests)]

    # ---- plumbing --------------------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        """Frame a command as multiprocessing.Connection does, so the engine reads it with ``Connection.recv``."""
        if self._writer is None or self._writer.is_closing():
            return
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(struct.pack("!i", len(data)) + data)

    def _on_eof(self) -> None:
        code = None
        if not self._stopping:  # (else shutdown reaps it: two threads in waitpid made one think it never exited)
            try:
                self._proc.join(0.5)  # usually already gone: its exit code tells a crash from a kill
                code = self._proc.exitcode
            except ValueError:  # shut down: the process object is closed
                pass
        self._die(EngineDeadError("engine shut down" if self._stopping else "engine process exited unexpectedly"
                                  + (f" (exit code {code})" if code is not None else "")))

    def wake(self, wave: int) -> None:
        """DP+EP: join lock-step wave ``wave`` if not already past it (``dp_lockstep.py``)."""
        if not self._stopping:
            self._send(("wake", wave))

    def _on_message(self, msg: tuple) -> None:
        if msg[0] == "out":
            self._route(msg[1])
            self._stats = msg[2]
        elif msg[0] == "wave":
            if self.on_wave is not None:
                self.on_wave(msg[1])
        else:  # "dead"
            self._die(EngineDeadError(f"engine error: {msg[1]}"))

    def _route(self, items: list[tuple[str, Any]]) -> None:
        for rid, x in items:
            if isinstance(x, str) and x == ACCEPTED:
                fut = self._pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
                continue
            if isinstance(x, BaseException):
                fut = self._pending.pop(rid, None)
                self._streams.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_exception(x)
                continue
            stream = self._streams.get(rid)
            if stream is None:  # aborted here; the engine's abort is on its way
                continue
            if stream.accumulate:
                x = stream.acc = _accumulate(stream.acc, x)
            if x.finished:
                del self._streams[rid]
                if stream.timer is not None:
                    stream.timer.cancel()
            elif self.stream_interval > 1 and stream.accumulate:  # cumulative: skipping loses nothing
                n = sum(len(c.token_ids) for c in x.outputs)
                if stream.released >= 0 and n - stream.released < self.stream_interval:
                    continue
                stream.released = n
            stream.queue.put_nowait(x)

    def _die(self, err: EngineDeadError) -> None:
        unexpected = not self._stopping and self.error is None
        if unexpected:
            logger.error("%s", err)
            self.error = err
        self._fail_all(err)
        if unexpected and self.on_dead is not None:
            self.on_dead(err)

    def fail_requests(self, err: BaseException) -> None:
        """End every in-flight request with ``err`` and abort it in the engine (a data-parallel sibling died and the
        server is exiting)."""
        for rid in list(self._streams):
            self._send(("abort", rid))
        self._fail_all(err)

    def _fail_all(self, err: BaseException) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        for s in self._streams.values():
            if s.timer is not None:
                s.timer.cancel()
            s.queue.put_nowait(err)
        self._streams.clear()


async def encode_stream(add_request: Callable[..., Any], prompt: PromptType, pooling_params: PoolingParams,
                        request_id: str, lora_request: Optional[LoRARequest], priority: int,
                        timeout: Optional[float], arrival_time: Optional[float]
                        ) -> AsyncIterator[PoolingRequestOutput]:
    """The body of ``encode`` (one engine or a data-parallel one: ``add_request`` is theirs)."""
    if not isinstance(pooling_params, PoolingParams):
        raise ParamError("pooling_params", f"must be PoolingParams, got {type(pooling_params).__name__}")
    stream = await add_request(request_id, prompt, pooling_params, arrival_time, priority or None, timeout,
                               lora_request)
    try:
        async for out in stream:
            yield out
    finally:
        stream.abort()  # (no-op once it finished) cancelled or closed early: free it in the engine


#: vLLM's name for the server's engine client.
AsyncLLM = AsyncEngine


def _stop_process(proc: Any, commands: Any, outputs: Any, timeout: float = 30.0) -> None:
    """Stop an engine process (if still running) and close its pipes: ``shutdown``'s last part, and the finalizer
    of an AsyncEngine dropped without it."""
    if proc.is_alive() and not commands.closed:
        try:
            commands.send(("stop",))
        except OSError:
            pass
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
    commands.close()
    outputs.close()
    proc.close()  # its sentinel descriptor


def _accumulate(acc: Optional[RequestOutput], d: RequestOutput) -> RequestOutput:
    """Fold a delta output into the cumulative one (updated in place: queued references all see the newest)."""
    if acc is None or len(acc.outputs) != len(d.outputs):  # first output (or best_of's final ranking)
        if acc is not None:
            d.prompt, d.prompt_token_ids, d.prompt_logprobs = acc.prompt, acc.prompt_token_ids, acc.prompt_logprobs
        return d
    for a, c in zip(acc.outputs, d.outputs):
        a.text += c.text
        a.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if a.logprobs is None:
                a.logprobs = []
            a.logprobs.extend(c.logprobs)
        a.cumulative_logprob, a.finish_reason, a.stop_reason = c.cumulative_logprob, c.finish_reason, c.stop_reason
    acc.finished, acc.num_cached_tokens, acc.metrics = d.finished, d.num_cached_tokens, d.metrics
    return acc


class _MessageReader(asyncio.Protocol):
    """Splits the engine's byte stream into messages (``multiprocessing.Connection`` framing: a big-endian int32
    length, then the pickle) and hands each to ``on_message`` on the event loop."""

    def __init__(self, on_message, on_eof):
        self.on_message = on_message
        self.on_eof = on_eof
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        while len(buf) - pos >= 4:
            (n,) = struct.unpack_from("!i", buf, pos)
            head = 4
            if n == -1:  # Connection's framing for messages over 2 GiB
                if len(buf) - pos < 12:
                    break
                (n,) = struct.unpack_from("!Q", buf, pos + 4)
                head = 12
            if len(buf) - pos < head + n:
                break
            msg = pickle.loads(memoryview(buf)[pos + head:pos + head + n])
            pos += head + n
            self.on_message(msg)
        del buf[:pos]

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.on_eof()
