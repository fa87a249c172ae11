"""Executors: how the ranks of one distributed engine start and get their steps (multiprocessing, Ray)."""

from pagedllm.executor.base import DistributedExecutor, WorkerDiedError, make_executor

__all__ = ["DistributedExecutor", "WorkerDiedError", "make_executor"]
