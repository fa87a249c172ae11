"""Which rank this process is and its tensor- and pipeline-parallel groups (vLLM's ``parallel_state`` names).

Global rank ``r`` of a ``tp x pp`` world is pipeline stage ``r // tp`` and tensor rank ``r % tp`` (vLLM's order:
the tensor-parallel ranks of one stage are neighbours). Outside a distributed engine the state is the trivial one
(tp = pp = 1) and no group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedllm.distributed.communicator import TorchCommunicator


@dataclass(frozen=True)
class ParallelConfig:
    """The shape of one engine's world (vLLM's ``ParallelConfig`` fields)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class ParallelState:
    rank: int
    config: ParallelConfig
    tp_group: Any = None  # Communicator over this stage's tensor-parallel ranks
    pp_group: Any = None  # Communicator over the pipeline stages of this tensor rank
    world_group: Any = None  # host-side gloo group of every rank (control: KV sizing)

    @property
    def tp_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def pp_size(self) -> int:
        return self.config.pipeline_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_STATE: Optional[ParallelState] = None
STARTUP_TIMEOUT_S = 600.0  # the rendezvous and start-up collectives: ranks import torch and load weights first


def initialize_model_parallel(rank: int, config: ParallelConfig, backend: Any, device: Any,
                              timeout_s: float) -> ParallelState:
    """Make the tp and pp groups (every rank makes every group, in the same order: ``new_group`` is collective)
    through the backend's ``pagedllm_communicator``; this process keeps the two it belongs to."""
    global _STATE
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    collective = backend.distributed_backend()
    state = ParallelState(rank, config)
    # Start-up work (KV sizing after every rank loaded its weights) waits on the slowest rank's load, not a step.
    state.world_group = TorchCommunicator(list(range(config.world_size)), torch.device("cpu"),
                                          max(timeout_s, STARTUP_TIMEOUT_S), "gloo")
    for stage in range(pp):
        ranks = [stage * tp + i for i in range(tp)]
        comm = backend.communicator(ranks, device, collective, timeout_s)
        if rank in ranks:
            state.tp_group = comm
    for t in range(tp):
        ranks = [stage * tp + t for stage in range(pp)]
        comm = backend.communicator(ranks, device, collective, timeout_s)
        if rank in ranks:
            state.pp_group = comm
    _STATE = state
    return state


def destroy_model_parallel() -> None:
    """Forget this process's groups (the executor's shutdown, after the process group is destroyed)."""
    global _STATE
    _STATE = None


def get_parallel_state() -> Optional[ParallelState]:
    """This process's state, or None outside a distributed engine."""
    return _STATE


def get_tp_group() -> Any:
    return _STATE.tp_group if _STATE is not None else None


def get_pp_group() -> Any:
    return _STATE.pp_group if _STATE is not None else None


def get_tensor_model_parallel_world_size() -> int:
    return _STATE.tp_size if _STATE is not None else 1


def get_tensor_model_parallel_rank() -> int:
    return _STATE.tp_rank if _STATE is not None else 0
