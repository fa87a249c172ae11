"""What every rank of a distributed engine runs: join the world, build its model shard and KV pool (a ``Worker``),
then run the driver's steps. Used in-process by the driver (rank 0), by the multiprocessing executor's worker
processes (``python -m pagedllm.executor FD``) and by the Ray executor's actors alike."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.communicator import init_world
from pagedllm.distributed.parallel_state import STARTUP_TIMEOUT_S, ParallelConfig, initialize_model_parallel
from pagedllm.errors import portable_exception
from pagedllm.distributed.binding import bind_rank, local_device, local_index
from pagedllm.executor.step import run_step
from pagedllm.backend.registry import get_backend
from pagedllm.models import load_config
from pagedllm.models.info import read_model_info
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)


def parallel_config(config: EngineConfig) -> ParallelConfig:
    return ParallelConfig(config.tensor_parallel_size, config.pipeline_parallel_size,
                          config.enable_expert_parallel)


class RankWorker:
    """One rank: its parallel state and its ``Worker`` (model shard, KV pool)."""

    def __init__(self, rank: int, config: EngineConfig, model_path: str, init_method: str,
                 cpus: Optional[frozenset[int]] = None, local_rank: Optional[int] = None):
        """``local_rank``: this rank's device index on its host; None: every rank on this host (the mp executor,
        the driver), so ``local_index(config, rank)``."""
        self.rank = rank
        self.threads = bind_rank(cpus)
        backend = get_backend(config.device)
        device = local_device(backend, local_index(config, rank) if local_rank is None else local_rank)
        backend.set_device(device)  # before the communicator: a device collective library binds to it
        pc = parallel_config(config)
        init_world(rank, pc.world_size, init_method, "gloo", max(config.distributed_timeout_s, STARTUP_TIMEOUT_S))
        self.par = initialize_model_parallel(rank, pc, backend, device, config.distributed_timeout_s)
        hf_config = load_config(model_path)
        info = read_model_info(model_path, hf_config, config.model_impl)
        self.worker = Worker(config, backend, model_path, hf_config, info, device=device)
        logger.info("rank %d (tp %d, pp %d) on %s: %d torch threads%s, %d KV blocks", rank, self.par.tp_rank,
                    self.par.pp_rank, device, self.threads, f" on CPUs {sorted(cpus)}" if cpus else "",
                    self.worker.num_blocks)
        # Sends of the last pp - 1 steps still travelling: a stage goes on to its next batch without waiting for the
        # next stage to take this one's hidden states. The driver submits step k only after the last stage
        # returned step k - pp, so every stage has by then received the sends of step k - pp and older.
        self._sends: deque[Callable[[], None]] = deque()

    def execute(self, payload: bytes) -> None:
        """A non-driver rank's step (the driver's broadcast, pickled once). Unpickled tensors keep the driver's
        device index: on an indexed device they move to this rank's first."""
        mbs = pickle.loads(payload)
        device = self.worker.device
        mbs = mbs if device.type == "cpu" else to_device(mbs, device)
        self._sends.append(run_step(self.worker.model, self.par, mbs))
        while len(self._sends) >= self.par.pp_size:
            self._sends.popleft()()

    def node_id(self) -> str:
        """The Ray node this rank runs on (Ray executor), for placement checks."""
        import ray  # optional: ray

        return ray.get_runtime_context().get_node_id()


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` (tensors inside dataclasses, lists, tuples, dicts) with every tensor on ``device``."""
    if isinstance(x, torch.Tensor):
        return x if x.device == device else x.to(device)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out = copy.copy(x)
        for f in dataclasses.fields(x):
            object.__setattr__(out, f.name, to_device(getattr(x, f.name), device))
        return out
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x


def _main(fd: int) -> int:
    """A multiprocessing-executor rank: read its start arguments from the driver's connection, report ready (or the
    error), then run every broadcast step until "stop" or the driver's end of the connection closes."""

    conn = Connection(fd)
    rank, config, model_path, init_method, cpus, log_level = pickle.loads(conn.recv_bytes())
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(asctime)s rank{rank} %(name)s: %(message)s")
    try:
        rw = RankWorker(rank, config, model_path, init_method, cpus)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(("error", portable_exception(e)))
        return 1
    conn.send(("ready", rw.worker.num_blocks))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            logger.info("rank %d: driver went away; exiting", rank)
            return 0
        if data == b"stop":
            return 0
        try:
            rw.execute(data)
        except Exception:  # a peer died or timed out: nothing to save, the driver reports the failure
            logger.exception("rank %d: step failed; exiting", rank)
            return 1

