"""Grammar compile worker processes: each parses and compiles one spec at a time for the server's compile pool.

Why processes: a compile's cost is the client's to choose (grammar size), parts of it hold the GIL (Python-side
parsing, llguidance's regex front end), and its memory is only given back when the process ends. The pool stops a
compile at its time limit, or when its client goes away, by killing the worker, and replaces a worker that grew by
more than ``worker_memory_bytes``; the server and the engine never run a grammar's parse or compile.

Why a zygote: importing xgrammar and llguidance and reading the vocabulary into them takes seconds (tens on a busy
host), too long to wait for after every kill. One zygote process does it once; every worker is an ``os.fork`` of it,
ready in milliseconds. The zygote forks before any grammar is compiled (xgrammar's compiler, which owns threads, is
made in each worker), never runs a job itself, and lets the kernel reap its children.

Protocols (``multiprocessing`` connections). Zygote: ``("ready", None)`` once warm; then per ``"fork"`` request the
new worker's end of a socket pair (``reduction.send_handle``) followed by its pid. Worker: ``("ready", None)``; then
per job (a ``StructuredOutputsParams``) one reply ``("ok", (backend name, serialized compiled grammar), retire)`` or
``("error", (field, message), retire)``; ``retire``: the worker exits after this reply.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, Sequence

from pagedllm.errors import ParamError
from pagedllm.proc_mem import rss_bytes


def _set_name(name: bytes) -> None:
    """The process name ``ps``/``top`` show (Linux ``PR_SET_NAME``), so an operator can tell grammar workers apart."""
    try:
        import ctypes  # stdlib; PR_SET_NAME is Linux's

        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def zygote_main(ctl: Connection, tokenizer_blob: bytes, vocab_size: int, stop_token_ids: Sequence[int],
                backend: str, memory_limit: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server owns shutdown; EOF on the pipe ends this loop
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    _set_name(b"grammar-zygote")
    try:
        os.nice(5)  # it and its workers (who inherit it) yield the CPU to the engine and the HTTP loop
    except OSError:
        pass
    from pagedllm.structured_output.manager import Backends  # heavy: torch, after the fork from the forkserver

    backends = Backends(pickle.loads(tokenizer_blob), vocab_size, stop_token_ids, backend)
    for name in backends.names:  # import the libraries and read the vocabulary once, for every worker
        try:
            backends.get(name)
        except ParamError:
            pass  # reported per job
    ctl.send(("ready", None))
    while True:
        try:
            ctl.recv()
        except (EOFError, OSError):
            return
        mine, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                ctl.close()
                mine.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _set_name(b"grammar-worker")
                serve(Connection(theirs.detach()), backends, memory_limit)
            except BaseException:  # noqa: BLE001 - a worker never returns into the zygote's loop
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        reduction.send_handle(ctl, mine.fileno(), pid)
        ctl.send(pid)
        mine.close()


def serve(conn: Connection, backends: Any, memory_limit: int) -> None:
    """A worker's loop: compile each spec received until EOF (or until it grew past ``memory_limit``)."""
    base = rss_bytes() or 0  # not Linux: 0, and no replacement by size
    conn.send(("ready", None))
    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError):
            return
        try:
            name, be, grammar = backends.parse(spec)
            reply = ("ok", (name, be.serialize(be.compile(grammar))))
        except ParamError as e:
            reply = ("error", (e.field, e.message))
        except Exception as e:  # noqa: BLE001 - RecursionError, MemoryError, a library's own errors
            reply = ("error", (f"structured_outputs.{spec.kind}",
                               f"cannot be compiled: {type(e).__name__}: {str(e)[:1000]}"))
        retire = memory_limit > 0 and (rss_bytes() or 0) - base > memory_limit
        try:
            conn.send((*reply, retire))
        except (EOFError, OSError):
            return
        if retire:
            return
