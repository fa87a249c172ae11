"""Tensor and pipeline parallelism inside one engine: parallel state, communicators, parallel layers, sharding."""

from pagedllm.distributed.communicator import CollectiveError, Communicator, TorchCommunicator
from pagedllm.distributed.parallel_state import (ParallelConfig, ParallelState, get_parallel_state, get_pp_group,
                                                 get_tensor_model_parallel_rank,
                                                 get_tensor_model_parallel_world_size, get_tp_group)

__all__ = ["CollectiveError", "Communicator", "ParallelConfig", "ParallelState", "TorchCommunicator",
           "get_parallel_state", "get_pp_group", "get_tensor_model_parallel_rank",
           "get_tensor_model_parallel_world_size", "get_tp_group"]
