"""Tensor parallelism over a device mesh: where each weight and KV page lives, and nothing else.

``PAGEDLLM_TPU_TP=N`` (default 1) runs the step on the first ``N`` devices of the platform as a 1-D mesh with axis
``"model"``, sharded Megatron-style as tpu-inference shards its JAX models over its ``MODEL`` mesh axis
(``tpu_inference/layers/common/sharding.py``): q/k/v and gate/up projections split by output columns (so each device
holds whole attention heads and their KV heads), o/down projections by input rows, the KV pages by (combined) KV
head, everything else replicated. Only placements are declared: the program is the same, and XLA's SPMD partitioner
inserts the collectives (the all-reduce after o_proj and down_proj), so results do not depend on ``N``. On JAX's CPU
device a mesh needs ``XLA_FLAGS=--xla_force_host_platform_device_count=N``.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import numpy as np

from pagedllm_tpu import platform

TP_ENV = "PAGEDLLM_TPU_TP"
AXIS = "model"
#: Parameter name -> how its dimensions map onto the mesh ("model" = split across devices).
_COLUMN = ("q_w", "k_w", "v_w", "gate_w", "up_w")
_COLUMN_BIAS = ("q_b", "k_b", "v_b", "gate_b", "up_b")
_ROW = ("o_w", "down_w")


def tp_size() -> int:
    try:
        n = int(os.environ.get(TP_ENV, "1"))
    except ValueError:
        raise ValueError(f"{TP_ENV} must be an integer, got {os.environ[TP_ENV]!r}") from None
    if n < 1:
        raise ValueError(f"{TP_ENV} must be >= 1, got {n}")
    return n


@lru_cache(maxsize=1)
def mesh() -> Any:
    import jax
    from jax.sharding import Mesh

    n = tp_size()
    devices = jax.devices(platform.requested_platform())
    if len(devices) < n:
        raise ValueError(f"{TP_ENV}={n} but jax sees {len(devices)} {platform.requested_platform()} device(s)")
    return Mesh(np.array(devices[:n]), (AXIS,))


def _named(*spec: Any) -> Any:
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh(), PartitionSpec(*spec))


def replicated() -> Any:
    return _named()


def kv_sharding() -> Any:
    """KV pages ``[N, P, 2 * Hkv, D]`` split over the combined-head axis: each device keeps its heads' K and V."""
    return _named(None, None, AXIS, None)


def param_sharding(name: str) -> Any:
    if name in _COLUMN:
        return _named(None, AXIS)
    if name in _COLUMN_BIAS:
        return _named(AXIS)
    if name in _ROW:
        return _named(AXIS, None)
    return replicated()


def shard_params(params: dict) -> dict:
    """``device_put`` every leaf of the parameter pytree with its sharding."""
    import jax

    def place(path: tuple, leaf: Any) -> Any:
        key = path[-1].key if hasattr(path[-1], "key") else str(path[-1])
        return jax.device_put(leaf, param_sharding(key))

    return jax.tree_util.tree_map_with_path(place, params)


def check_divisible(num_heads: int, num_kv_heads: int, intermediate: int) -> None:
    n = tp_size()
    for what, value in (("attention heads", num_heads), ("KV heads", num_kv_heads),
                        ("MLP intermediate size", intermediate)):
        if value % n:
            raise ValueError(f"{TP_ENV}={n} does not divide the model's {what} ({value})")
