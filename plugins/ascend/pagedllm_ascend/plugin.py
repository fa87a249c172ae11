"""The ``ascend`` backend's hooks (entry point ``ascend`` in group ``pagedllm.backends``): Huawei Ascend NPUs
through torch-npu.

Not verified on hardware. Every vendor call is written against torch-npu's API as vllm-ascend uses it (sources
cited where each call is made) and tested on CPU through a simulated torch-npu kept in the tests
(``tests/support/sim/torch_npu``). Loading this module imports nothing vendor; torch-npu loads when a hook first
needs the device (the probe only imports it once the CANN runtime is found).

KV caches: a ``(key_cache, value_cache)`` pair per layer (``kv_cache.py``), so this backend implements every
cache hook itself (write, gather, swap, host caches) — core's reference ops only know the canonical layout.
rms_norm and silu_and_mul go through torch-npu's fused ops (``ops.py``); rotary stays on core's torch reference.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional

import torch

from pagedllm.backend.hookspec import (API_VERSION, BackendInfo, Capabilities, GraphRunner, KVCacheSpec, MemoryInfo,
                               ModelInfo, ProbeResult, hookimpl)
from pagedllm.backend import ParamError
from pagedllm_ascend import attention, graph, ops, platform
from pagedllm_ascend import kv_cache as _kv
from pagedllm_ascend.vendor import npu

#: vllm-ascend's default block size (and the one its kernels are exercised with); the only one declared.
BLOCK_SIZE = 128
#: npu_fused_infer_attention_score takes FLOAT16/BFLOAT16 query and key/value (torch_npu API reference).
DTYPES = ("bfloat16", "float16")
HEAD_SIZES = (64, 128)


@hookimpl
def pagedllm_backend_info() -> BackendInfo:
    return BackendInfo(name="ascend", device_type="npu", priority=90, api_version=API_VERSION, extra="ascend",
                       description="Huawei Ascend NPUs via torch-npu: separate K/V paged caches, torch-npu paged "
                                   "attention, hccl (not verified on hardware)")


@hookimpl
def pagedllm_probe() -> ProbeResult:
    return platform.probe()


@hookimpl
def pagedllm_capabilities() -> Capabilities:
    return Capabilities(dtypes=DTYPES, kv_cache_dtypes=("auto",), head_sizes=HEAD_SIZES, block_sizes=(BLOCK_SIZE,),
                        graph_capture="decode" if graph.enabled() else "none", sliding_window=True,
                        soft_cap=False, mla=False)


@hookimpl
def pagedllm_update_config(config: Any, model_info: ModelInfo) -> Optional[dict]:
    """Block size 128 unless the user chose another (refused: the kernels are used with 128 here); ``auto`` dtype is
    the checkpoint's when it is half precision, else bfloat16; float32 is refused with the reason."""
    changes: dict = {}
    if config.block_size is None:
        changes["block_size"] = BLOCK_SIZE
    elif config.block_size != BLOCK_SIZE:
        raise ParamError("block_size", f"the ascend backend runs torch-npu's paged attention with {BLOCK_SIZE}-token "
                                       f"blocks (vllm-ascend's default), not {config.block_size}")
    if config.dtype == "auto":
        changes["dtype"] = model_info.dtype if model_info.dtype in DTYPES else "bfloat16"
    elif config.dtype in ("float32", "float", "fp32"):
        raise ParamError("dtype", "torch-npu's attention kernels (npu_fused_infer_attention_score, "
                                  "_npu_paged_attention) take float16 or bfloat16, not float32")
    return changes or None


@lru_cache(maxsize=1)
def pinned_host_available() -> bool:
    """Whether this torch can page-lock host memory for the device (torch-npu registers the pinned allocator)."""
    try:
        torch.empty(1, pin_memory=True)
        return True
    except (RuntimeError, NotImplementedError):
        return False


@hookimpl
def pagedllm_memory_info(device: torch.device) -> MemoryInfo:
    free, total = npu().mem_get_info(device)
    return MemoryInfo(total_bytes=int(total), free_bytes=int(free), pinned_host=pinned_host_available())


@hookimpl
def pagedllm_memory_peak(device: torch.device) -> int:
    mod = npu()
    peak = mod.max_memory_allocated(device)
    mod.reset_peak_memory_stats(device)
    return int(peak)


@hookimpl
def pagedllm_distributed_backend() -> str:
    return "hccl"  # torch-npu registers HCCL as a torch.distributed backend


@hookimpl
def pagedllm_set_device(device: torch.device) -> None:
    npu().set_device(device)


@hookimpl
def pagedllm_synchronize(device: torch.device) -> None:
    npu().synchronize(device)


@hookimpl
def pagedllm_allocate_kv_cache(spec: KVCacheSpec) -> list:
    return _kv.allocate(spec)


@hookimpl
def pagedllm_allocate_host_kv_cache(spec: KVCacheSpec, pin_memory: bool) -> list:
    return _kv.allocate(spec, pin_memory=pin_memory)


@hookimpl
def pagedllm_write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: Any, slot_mapping: torch.Tensor) -> None:
    attention.write_kv(key, value, kv_cache, slot_mapping)


@hookimpl
def pagedllm_paged_attention(query: torch.Tensor, kv_cache: Any, meta: Any, scale: float,
                             sliding_window: Optional[int], soft_cap: Optional[float],
                             alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    if alibi_slopes is not None:
        raise NotImplementedError("this backend does not declare Capabilities.alibi")
    return attention.paged_attention(query, kv_cache, meta, scale, sliding_window, soft_cap)


@hookimpl
def pagedllm_gather_kv_blocks(kv_cache: Any, block_ids: torch.Tensor) -> torch.Tensor:
    return _kv.gather(kv_cache, block_ids)


@hookimpl
def pagedllm_swap_kv_blocks(src_caches: list, dst_caches: list, src: torch.Tensor, dst: torch.Tensor) -> None:
    _kv.swap_blocks(src_caches, dst_caches, src, dst)


@hookimpl
def pagedllm_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return ops.rms_norm(x, weight, eps)


@hookimpl
def pagedllm_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return ops.silu_and_mul(x)


@hookimpl
def pagedllm_graph_runner(model: Any, max_num_seqs: int, device: torch.device, ctx: Any) -> GraphRunner:
    """Eager, or ACL graphs for decode batches when opted in (``PAGEDLLM_ASCEND_ACL_GRAPH=1``, see graph.py)."""
    return graph.make_runner(model, max_num_seqs, device, ctx)
