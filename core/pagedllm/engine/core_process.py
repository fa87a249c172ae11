"""The engine process: owns the LLMEngine and runs its step loop; talks to the server process over two pipes.

Why a process (vLLM v1's EngineCore split): the engine's Python work (scheduling, sampling, detokenising) and the
server's (HTTP, JSON, SSE) run in parallel instead of taking turns on one GIL, an engine crash leaves a server that
answers 503 instead of a dead one, and every torch op runs on this process's main thread (one OpenMP team).

Protocol: one pipe each way, pickled tuples in ``multiprocessing.Connection`` framing. Server -> engine:
``("add", rid, prompt, params, arrival, priority, lora_request)``, ``("abort", rid)``, ``("add_lora", rid,
lora_request)``, ``("remove_lora", rid, lora_int_id)`` (answered like an add), ``("stop",)``. Engine -> server:
``("ready", info)`` or ``("error", exc)`` once, then ``("out", items, stats)`` after every loop turn that did
something, where ``items`` are ``(rid, x)`` with ``x`` :data:`ACCEPTED`, an exception (the add was rejected) or a
RequestOutput (deltas: the server asks for ``output_kind="delta"`` and accumulates) or, for a request added with
PoolingParams, its one final PoolingRequestOutput; and ``("dead", message)`` if the
engine hit a bug. The loop blocks on the pipe whenever no request is unfinished: an idle engine burns no CPU.
However the loop ends (a "stop", the server gone, a bug) the engine is shut down before the process exits (a
distributed engine's ranks stop), and the process ends with the server process however that ends
(``executor/parent_watch.py``), even mid-load.
A DP+EP replica (``dp_lockstep.py``) also sends ``("wave", w)`` when it starts lock-step wave ``w`` and takes
``("wake", w)`` to join one another replica started.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Optional, Sequence

from pagedllm.config import EngineConfig
from pagedllm.errors import portable_exception
from pagedllm.engine.cpu_split import pin_engine
from pagedllm.engine.gc_policy import freeze_startup_heap
from pagedllm.backend.registry import get_backend
from pagedllm.distributed.dp_ep import init_dp_ep
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.parent_watch import exit_with_parent

logger = logging.getLogger(__name__)

ACCEPTED = "accepted"  # reply to an add the engine validated and queued


def run_engine_core(config: EngineConfig, commands: Connection, outputs: Connection,
                    log_level: int = logging.INFO, cpus: Optional[frozenset[int]] = None,
                    lora_modules: Sequence = (), dp_ep: Any = None, parent: Optional[tuple[int, bool]] = None
                    ) -> None:
    """Process entry point (spawned by :class:`~pagedllm.engine.async_engine.AsyncEngine`). ``parent``: (the
    server's pid, whether it started this process from its main thread) — this process exits when it dies.

    Ends with ``os._exit``: the process holds nothing that needs interpreter finalization (its pipes close with
    it), and finalization makes nanobind-based extensions that transformers' imports load (Triton) print hundreds
    of "leaked" lines into the server's log on every shutdown.
    """
    code = 1
    try:
        if parent is not None:
            exit_with_parent(*parent)
        # tqdm's default lock is a named semaphore, which ``os._exit`` leaves for the resource tracker to complain
        # about; one process writes these bars, so a thread lock does.
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())
        _run(config, commands, outputs, log_level, cpus, lora_modules, dp_ep)
        code = 0
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(config: EngineConfig, commands: Connection, outputs: Connection, log_level: int,
         cpus: Optional[frozenset[int]], lora_modules: Sequence, dp_ep: Any = None) -> None:
    # The server process owns shutdown (it drains, then sends "stop"); a terminal's Ctrl-C or a service manager's
    # SIGTERM to the whole process group must not kill requests mid-flight. If the server dies, the pipe closes
    # and this loop exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        if cpus:
            threads = pin_engine(cpus)
            logger.info("engine process on CPUs %s, %d torch threads", ",".join(map(str, sorted(cpus))), threads)
        if dp_ep is not None:  # a DP+EP replica: join the other replicas before the model (and its experts) loads
            init_dp_ep(dp_ep, get_backend(config.device))
        engine = LLMEngine(config)
        for lora in lora_modules:  # --lora-modules: a bad folder fails the start, naming it
            engine.add_lora(lora)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which re-raises it
        outputs.send(("error", portable_exception(e)))
        return
    freeze_startup_heap()  # the model and its imports live for good; full passes rare (gc_policy.py)
    info = {"max_model_len": engine.max_model_len, "model_path": engine.model_path,
            "vocab_size": engine.model.vocab_size, "stats": engine.get_stats(),
            "supported_tasks": engine.get_supported_tasks(),  # the server routes and refuses requests by them
            # data-parallel cache-aware routing keys its record of this replica's prefix cache on these
            "kv_cache": {"block_size": engine.kv.block_size, "prefix_caching": engine.kv.enable_caching}}
    if dp_ep is not None:
        from pagedllm.engine.dp_lockstep import expert_info, lockstep_loop  # cycle: dp_lockstep imports this module

        info["expert_parallel"] = expert_info(engine)
    try:
        outputs.send(("ready", info))
        (_loop if dp_ep is None else lockstep_loop)(engine, commands, outputs)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("server process went away; engine exiting")
    except BaseException as e:  # noqa: BLE001 - a bug in the engine: tell the server, then exit
        logger.exception("engine died")
        try:
            outputs.send(("dead", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
    finally:
        engine.shutdown()  # os._exit follows: no finalizer would run


def drain(engine, commands: Connection, items: list[tuple[str, object]]) -> tuple[bool, list[int]]:
    """Run every command waiting on the pipe (replies appended to ``items``); returns (stop asked, the waves of
    any DP+EP "wake" commands)."""
    stop, wakes = False, []
    while commands.poll():
        cmd = commands.recv()
        kind = cmd[0]
        if kind in ("add", "add_lora", "remove_lora"):
            rid = cmd[1]
            try:
                if kind == "add":
                    _, rid, prompt, params, arrival, priority, lora = cmd
                    engine.add_request(rid, prompt, params, arrival_time=arrival, priority=priority,
                                       lora_request=lora)
                elif kind == "add_lora":
                    engine.add_lora(cmd[2])
                else:
                    engine.remove_lora(cmd[2])
            except Exception as e:  # ParamError and friends go back to that request only
                items.append((rid, portable_exception(e)))
                continue
            items.append((rid, ACCEPTED))
        elif kind == "abort":
            engine.abort_request(cmd[1])
        elif kind == "wake":
            wakes.append(cmd[1])
        elif kind == "stop":
            stop = True
    return stop, wakes


def finish(engine, outputs: Connection) -> None:
    """Abort what is left and send the final stats (a "stop" command)."""
    st = engine.get_stats()
    logger.info("engine stopping: %d steps, %d prompt and %d generated tokens, %d unfinished requests aborted",
                st.num_steps, st.prompt_tokens, st.generation_tokens, len(engine.parents))
    engine.abort_request(list(engine.parents))
    outputs.send(("out", [], engine.get_stats()))


def _loop(engine, commands: Connection, outputs: Connection) -> None:
    while True:
        if not engine.has_unfinished_requests():
            commands.poll(None)  # sleep until a command (or EOF) arrives
        items: list[tuple[str, object]] = []
        stop, _ = drain(engine, commands, items)
        if stop:
            finish(engine, outputs)
            return
        if engine.has_unfinished_requests():
            items.extend((o.request_id, o) for o in engine.step())
        # Stats are taken after the step (a client that sees its final output and then scrapes /metrics sees the
        # blocks of its request already freed); pickling them is the snapshot, so no copy is made here.
        outputs.send(("out", items, engine.get_stats()))
