"""The Gaudi backend's hook implementations (entry point ``gaudi`` in group ``pagedllm.backends``).

Written against the Intel Gaudi PyTorch bridge's documented API and vllm-gaudi's use of it (each call cites its
source); exercised on CPU through a simulated ``habana_frameworks`` in the tests (``VLLM_USE_FAKE_HPU=1``).
Not verified on hardware. Loading this module imports nothing from ``habana_frameworks`` (``vendor.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from pagedllm.backend.batch_policy import BucketPolicy
from pagedllm.backend.hookspec import (API_VERSION, BackendInfo, Capabilities, GraphRunner, KVCacheSpec, MemoryInfo,
                               ModelInfo, ProbeResult, RunnerContext, hookimpl)
from pagedllm.backend import ParamError
from pagedllm_gaudi import bucketing, flat_pa, graph, vendor
from pagedllm_gaudi import kv_cache as _kv

logger = logging.getLogger(__name__)

#: vllm-gaudi's default block size ("default block size for Gaudi should be 128; smaller sizes still work, but very
#: inefficiently": vllm_gaudi/platform.py ``check_and_update_config``).
BLOCK_SIZE = 128

_peak_baseline: dict[str, int] = {}


@hookimpl
def pagedllm_backend_info() -> BackendInfo:
    return BackendInfo(name="gaudi", device_type=vendor.device_type(), priority=90, api_version=API_VERSION,
                       extra="gaudi", description="Intel Gaudi (HPU): bucketed static shapes, HPU graphs, "
                                                  "flat-block paged attention, hccl (not verified on hardware)")


@hookimpl
def pagedllm_probe() -> ProbeResult:
    if not vendor.installed():
        return ProbeResult(False, f"habana_frameworks not installed ({vendor.INSTALL_HINT})")
    try:
        hpu = vendor.hpu()
    except Exception as e:  # a bridge built for another torch, a missing driver library...
        return ProbeResult(False, f"habana_frameworks.torch failed to import: {type(e).__name__}: {e} "
                                  f"({vendor.INSTALL_HINT})")
    if vendor.fake_hpu():
        return ProbeResult(True, "VLLM_USE_FAKE_HPU=1: HPU code path on host tensors (simulation, not a Gaudi)",
                           "fake HPU (cpu)")
    try:
        # habana_frameworks.torch.hpu.is_available / device_count / get_device_name (gaudi-pytorch-bridge
        # python_packages/habana_frameworks/torch/hpu/__init__.py)
        if not hpu.is_available() or hpu.device_count() < 1:
            return ProbeResult(False, "habana_frameworks is installed but no Gaudi device is visible "
                                      "(driver loaded? HABANA_VISIBLE_DEVICES?)")
        return ProbeResult(True, f"{hpu.device_count()} HPU(s), lazy mode {vendor.is_lazy()}",
                           str(hpu.get_device_name()))
    except Exception as e:
        return ProbeResult(False, f"HPU query failed: {type(e).__name__}: {e}")


@hookimpl
def pagedllm_capabilities() -> Capabilities:
    return Capabilities(
        dtypes=("bfloat16", "float32"),  # bf16 is the default; float32 is the exact path (tests, parity)
        kv_cache_dtypes=("auto",),
        head_sizes=None,  # flat_pa is batched matmuls over any head size (vllm-gaudi allows 1..576)
        block_sizes=(BLOCK_SIZE,),
        graph_capture="full",
        sliding_window=True,
        soft_cap=True,
        mla=False,  # its own KV layout ignores KVCacheSpec.mla
        on_device_sampling=True,
    )


@hookimpl
def pagedllm_update_config(config: Any, model_info: ModelInfo) -> Optional[dict]:
    """Block size 128 and bf16 by default (vllm_gaudi/platform.py ``check_and_update_config``); refuse, with the
    reason, what the plugin cannot run instead of letting vllm-gaudi-style silent rewrites happen."""
    if config.block_size is not None and config.block_size != BLOCK_SIZE:
        raise ParamError("block_size", f"{config.block_size}: the gaudi backend runs {BLOCK_SIZE}-token blocks only "
                                       f"(the size its bucketing and flat paged attention are built for; vllm-gaudi "
                                       f"defaults to it too); leave block_size unset")
    if config.dtype in ("float16", "half", "fp16"):
        raise ParamError("dtype", "float16 is not supported on Gaudi by this backend (vllm-gaudi replaces it with "
                                  "bfloat16); use bfloat16, or float32 for exact checks")
    if config.kv_cache_dtype != "auto":
        raise ParamError("kv_cache_dtype", f"{config.kv_cache_dtype!r}: the gaudi backend stores KV in the model "
                                           f"dtype only (fp8 KV needs vllm-gaudi's INC scales, not implemented)")
    if model_info.quantization is not None:
        raise ParamError("model", f"{model_info.quantization} checkpoints are not supported by the gaudi backend "
                                  f"(no quantized matmuls); use a safetensors checkpoint")
    changes: dict = {"block_size": BLOCK_SIZE}
    if config.dtype == "auto":
        changes["dtype"] = "bfloat16"
    elif config.dtype in ("float32", "float", "fp32"):
        logger.warning("gaudi: float32 runs, but slowly on the matrix engine; vllm-gaudi would use bfloat16")
    return changes


@hookimpl
def pagedllm_batch_policy(ctx: RunnerContext) -> BucketPolicy:
    return bucketing.gaudi_bucket_policy(ctx)


@hookimpl
def pagedllm_memory_info(device: torch.device) -> MemoryInfo:
    # habana_frameworks.torch.hpu.mem_get_info() -> (Limit - InUse, Limit) (gaudi-pytorch-bridge
    # python_packages/habana_frameworks/torch/hpu/memory.py; vllm-gaudi HabanaMemoryProfiler). No pinned host
    # memory (vllm_gaudi/platform.py is_pin_memory_available returns False).
    free, total = vendor.hpu().mem_get_info()
    return MemoryInfo(total_bytes=int(total), free_bytes=int(free), pinned_host=False)


@hookimpl
def pagedllm_memory_peak(device: torch.device) -> Optional[int]:
    """Activation peak: ``max_memory_allocated()`` (memory_stats ``MaxInUse``) above what was in use at the previous
    ``reset_peak_memory_stats()`` (gaudi-pytorch-bridge .../hpu/memory.py), so weights are not counted twice."""
    hpu = vendor.hpu()
    key = str(device)
    peak = max(0, int(hpu.max_memory_allocated()) - _peak_baseline.get(key, 0))
    hpu.reset_peak_memory_stats()
    _peak_baseline[key] = int(hpu.memory_allocated())
    return peak


@hookimpl
def pagedllm_distributed_backend() -> str:
    return "hccl"  # vllm_gaudi/v1/worker/hpu_worker.py init_distributed_environment(..., backend='hccl')


@hookimpl
def pagedllm_set_device(device: torch.device) -> None:
    """Nothing: one process sees its HPU through HABANA_VISIBLE_DEVICES (vllm_gaudi/platform.py ``set_device``
    returns without a call)."""
    return None


@hookimpl
def pagedllm_synchronize(device: torch.device) -> None:
    vendor.hpu().synchronize()  # habana_frameworks.torch.hpu.synchronize (vllm-gaudi hpu_worker.py)


@hookimpl
def pagedllm_allocate_kv_cache(spec: KVCacheSpec) -> list:
    return _kv.allocate(spec, spec.device)


@hookimpl
def pagedllm_allocate_host_kv_cache(spec: KVCacheSpec, pin_memory: bool) -> list:
    return _kv.allocate(spec, torch.device("cpu"), pin_memory=pin_memory)


@hookimpl
def pagedllm_write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: Any, slot_mapping: torch.Tensor) -> None:
    _kv.write_kv(key, value, kv_cache, slot_mapping)


@hookimpl
def pagedllm_paged_attention(query: torch.Tensor, kv_cache: Any, meta: Any, scale: float,
                             sliding_window: Optional[int], soft_cap: Optional[float],
                             alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    if alibi_slopes is not None:
        raise NotImplementedError("this backend does not declare Capabilities.alibi")
    return flat_pa.paged_attention(query, kv_cache[0], kv_cache[1], meta, scale, sliding_window, soft_cap)


@hookimpl
def pagedllm_gather_kv_blocks(kv_cache: Any, block_ids: torch.Tensor) -> torch.Tensor:
    return _kv.gather(kv_cache, block_ids)


@hookimpl
def pagedllm_swap_kv_blocks(src_caches: list, dst_caches: list, src: torch.Tensor, dst: torch.Tensor) -> None:
    _kv.swap_blocks(src_caches, dst_caches, src, dst)
    _mark_step_on_device(src_caches + dst_caches)


def _mark_step_on_device(caches: list) -> None:
    """vllm_gaudi/extension/cache_ops.py ends a block swap with mark_step when the cache is on an HPU."""
    if any(c[0].device.type == "hpu" for c in caches):
        vendor.mark_step()


@hookimpl
def pagedllm_model_runner(ctx: RunnerContext, model: Any, kv: Any) -> None:
    """Core's model runner is kept; this only adds the per-layer mark_step hooks, which eager mode
    (``enforce_eager``: no graph runner) needs too."""
    graph.add_layer_mark_steps(model)
    return None


@hookimpl
def pagedllm_graph_runner(model: Any, max_num_seqs: int, device: torch.device, ctx: RunnerContext) -> GraphRunner:
    return graph.make_runner(model, ctx)
