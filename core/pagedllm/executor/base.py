"""The driver side of a distributed engine (vLLM's ``Executor``): rank 0 runs in the engine's own process and owns
the ``Worker`` the engine talks to; the other ranks run elsewhere (worker processes, Ray actors) and get each step
as one broadcast. Subclasses say how the other ranks start, receive a step and are checked for life.

Lifecycle: ``shutdown`` (idempotent; the engine's, at the latest when the engine is garbage collected or the
interpreter exits) stops the other ranks, destroys the process group and drops this process's parallel state, so
another distributed engine can start in the same process. torch.distributed has one process group per process, so
two distributed engines cannot be live at once: starting one while another is refuses with a message saying so
(after collecting a dropped one that only a reference cycle kept), instead of hanging in a rendezvous.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import pickle
import socket
import time
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.distributed.binding import bind_rank, pin_process
from pagedllm.distributed.parallel_state import destroy_model_parallel
from pagedllm.distributed.sharding import check_shardable
from pagedllm.errors import ParamError
from pagedllm.executor.rank_worker import RankWorker
from pagedllm.executor.step import run_step, split_micro_batches
from pagedllm.models import load_config

logger = logging.getLogger(__name__)


_LIVE: "weakref.WeakSet[DistributedExecutor]" = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for ex in list(_LIVE):
        ex.shutdown()


class WorkerDiedError(RuntimeError):
    """A rank of the distributed engine died or stopped answering; the engine cannot go on."""


def check_no_live_engine() -> None:
    """Refuse to start a distributed engine while this process holds another one's process group."""
    if any(not ex.closed for ex in list(_LIVE)):
        gc.collect()  # a dropped engine that only a reference cycle kept: its finalizer shuts it down
    live = [ex for ex in list(_LIVE) if not ex.closed]
    if live:
        ex = live[0]
        raise RuntimeError(f"another distributed engine is still running in this process (tensor_parallel_size="
                           f"{ex.config.tensor_parallel_size}, pipeline_parallel_size="
                           f"{ex.config.pipeline_parallel_size}, {ex.name} executor): torch.distributed holds one "
                           "process group per process. Shut it down first: llm.shutdown(), or create it with "
                           "`with LLM(...) as llm:`")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed's process group is already initialized in this process (not by a "
                           "pagedllm engine); a distributed engine makes its own: call "
                           "torch.distributed.destroy_process_group() first")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DistributedExecutor:
    """Rank 0 here; ``_start_ranks`` / ``_broadcast`` / ``_after_step`` / ``_check`` / ``_stop_ranks`` elsewhere."""

    name = "?"
    failure_grace_s = 0.0  # how long a failed step waits for a dying rank's exit status, to name it
    stop_timeout_s = 10.0  # how long shutdown waits for the other ranks to exit before it kills them

    def __init__(self, config: EngineConfig, model_path: str):
        self.config, self.model_path = config, model_path
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.num_steps = 0
        # vLLM's Executor.max_concurrent_batches: steps the engine may keep in flight (one per pipeline stage);
        # 1 turns the batch queue off (each step is then cut into micro-batches instead).
        self.max_concurrent_batches = config.pipeline_parallel_size
        self.num_in_flight = self.max_in_flight = 0  # steps submitted and not yet collected; the most at once
        self.num_overlapped_submits = 0  # steps submitted while an earlier one was still in flight
        self._saved_affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self._saved_threads = torch.get_num_threads()
        self._closed = False
        _LIVE.add(self)  # shut down at exit at the latest (the engine's finalizer does it when it is dropped)
        try:
            init_method, self.driver_cpus = self._start_ranks()
            self.driver = RankWorker(0, config, model_path, init_method, self.driver_cpus)
            self._wait_ready()
            if self.driver.worker.policy.static:
                raise ParamError("tensor_parallel_size", f"backend {config.device!r} pads to static batch shapes, "
                                                         "which the distributed step does not do yet")
        except BaseException as e:
            self.shutdown()
            dead = self._dead_ranks()
            if dead and not isinstance(e, WorkerDiedError):
                raise WorkerDiedError(f"distributed engine start failed: {dead} ({e})") from e
            raise
        self.par = self.driver.par

    @property
    def driver_worker(self) -> Any:
        return self.driver.worker

    @property
    def closed(self) -> bool:
        """Shut down (or failed to start): the other ranks are gone and the process group destroyed."""
        return self._closed

    def rebind(self) -> int:
        """Pin this process to rank 0's CPUs and threads again (a benchmark that ran something else in between)."""
        return bind_rank(self.driver_cpus)

    def attach(self, runner: Any) -> None:
        """Route the driver's model runner through every rank (under pipeline parallelism without waiting for the
        last stage: ``submit_logits``)."""
        runner.forward_logits = self.forward_logits
        if self.par.pp_size > 1:
            runner.submit_logits = self.submit_logits

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                       idx: list[int]) -> Optional[torch.Tensor]:
        """One step on every rank; the logits of rows ``idx`` (float32, in ``idx`` order)."""
        return self.submit_logits(input_ids, positions, meta, idx)()

    def submit_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                      idx: list[int]) -> Callable[[], Optional[torch.Tensor]]:
        """Start one step on every rank: one broadcast of the prepared tensors, then this rank's part. Returns at
        once under pipeline parallelism (the later stages still run it); calling the result waits for the logits
        of rows ``idx``. Steps must be waited for in the order they were submitted."""
        if self._closed:
            raise WorkerDiedError("the distributed engine was shut down")
        dead = self._dead_ranks()
        if dead:
            raise WorkerDiedError(f"distributed engine: {dead}")
        # Several batches in flight already keep every stage busy; one at a time, cut it into micro-batches.
        n = self.config.pipeline_parallel_size if self.max_concurrent_batches == 1 else 1
        mbs, order = split_micro_batches(input_ids, positions, meta, idx, n)
        payload = pickle.dumps(mbs, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            handle = self._broadcast(payload)
            wait = run_step(self.driver.worker.model, self.par, mbs)
        except Exception as e:
            raise self._failure(e) from e
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        self.num_overlapped_submits += self.num_in_flight > 1

        def result() -> Optional[torch.Tensor]:
            try:
                logits = wait()
                self._after_step(handle)
            except Exception as e:
                raise self._failure(e) from e
            finally:
                self.num_in_flight -= 1
            self.num_steps += 1
            if logits is None or order == list(range(len(order))):
                return logits
            out = torch.empty_like(logits)
            out[torch.tensor(order, dtype=torch.long)] = logits
            return out
        return result

    def _failure(self, e: Exception) -> WorkerDiedError:
        dead = self._dead_ranks()
        deadline = time.monotonic() + self.failure_grace_s  # a reset connection can beat the exit status
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self._dead_ranks()
        return WorkerDiedError(f"distributed step failed: {dead or 'a rank stopped answering'} "
                               f"({type(e).__name__}: {e})")

    def shutdown(self) -> None:
        """Stop every rank, leave the process group, give this process its CPUs and threads back (idempotent).
        Rank 0's model and communicators (a shared-memory mapping among them) go with the last reference to them:
        the engine drops its own."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        try:
            self._stop_ranks()
        finally:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            finally:
                destroy_model_parallel()
                self.driver = self.par = None
                if self._saved_affinity is not None:
                    pin_process(frozenset(self._saved_affinity))
                torch.set_num_threads(self._saved_threads)

    # ---- per executor ------------------------------------------------------------------------------------
    def _start_ranks(self) -> tuple[str, Optional[frozenset[int]]]:
        """Start ranks 1..N-1 (they block in the rendezvous); returns the init method and rank 0's CPUs."""
        raise NotImplementedError

    def _wait_ready(self) -> None:
        raise NotImplementedError

    def _broadcast(self, payload: bytes) -> Any:
        """Send the step to ranks 1..N-1; returns what ``_after_step`` needs to wait for them."""
        raise NotImplementedError

    def _after_step(self, handle: Any) -> None:
        """Wait for the other ranks' part of a step (called when its logits are collected)."""

    def _dead_ranks(self) -> str:
        """A description of the ranks that died ('' if none)."""
        return ""

    def _stop_ranks(self) -> None:
        raise NotImplementedError


def make_executor(config: EngineConfig, model_path: str) -> Optional[DistributedExecutor]:
    """The executor ``config.distributed_executor_backend`` names (mp by default), or None for a one-rank engine."""
    if config.enable_expert_parallel and config.tensor_parallel_size == 1:
        raise ParamError("enable_expert_parallel", "needs tensor_parallel_size > 1 (experts split across its ranks)")
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        return None
    check_shardable(load_config(model_path), config.tensor_parallel_size, config.pipeline_parallel_size,
                    config.enable_expert_parallel)
    check_no_live_engine()
    if config.distributed_executor_backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor  # cycle: it subclasses ours; optional: ray

        return RayExecutor(config, model_path)
    from pagedllm.executor.mp_executor import MultiprocExecutor  # cycle: it subclasses ours

    return MultiprocExecutor(config, model_path)
