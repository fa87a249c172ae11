"""The ``xpu`` backend: Intel GPUs through stock ``torch.xpu``, core's portable Triton kernels, XPU graphs, xccl.

The op hooks are core's Triton kernels (``pagedllm.backend.triton.hooks``, as the cuda/rocm plugins use them); Triton
compiles them for Intel GPUs through pytorch-triton-xpu. Runtime hooks mirror ``pagedllm.backend.accelerator`` with
``torch.xpu`` in place of ``torch.cuda`` (that module calls ``torch.cuda`` directly, so it cannot be reused as is).
Every torch.xpu call is looked up when the hook runs, never at import: loading this module imports neither Triton
nor any Intel runtime library. Not verified on hardware.

Sources for the calls: vllm/platforms/xpu.py (``dist_backend = "xccl"``, ``torch.xpu.set_device``,
``get_device_name``, ``is_pin_memory_available() -> True``, ``max_memory_allocated`` + ``reset_peak_memory_stats``
for the profiling run, XPU graphs supported from torch 2.11 by ``supports_xpu_graph``); torch 2.13's
``torch/xpu/graphs.py`` (``XPUGraph``, ``graph(xpu_graph, pool, stream)``, ``graph_pool_handle``) and
``torch/xpu/memory.py`` (``mem_get_info(device) -> (free, total)``).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from pagedllm.backend.hookspec import BackendInfo, Capabilities, GraphRunner, MemoryInfo, ModelInfo, ProbeResult, hookimpl
from pagedllm.backend import ParamError
from pagedllm.backend.triton.hooks import (pagedllm_paged_attention, pagedllm_rms_norm,  # noqa: F401
                                         pagedllm_rotary, pagedllm_silu_and_mul, pagedllm_write_kv)
from pagedllm_xpu import xpu_probe

#: What core's Triton kernels take (pagedllm.backend.accelerator.HEAD_SIZES / BLOCK_SIZES: same kernels).
HEAD_SIZES = (32, 64, 80, 96, 128, 256)
BLOCK_SIZES = (16, 32)
#: Set to 0 to run eagerly (core's PAGEDLLM_DISABLE_GRAPHS=1 also does); vLLM gates XPU graphs the same way
#: (VLLM_XPU_ENABLE_XPU_GRAPH) because they are new in torch.
GRAPHS_ENV = "PAGEDLLM_XPU_GRAPHS"


def graphs_enabled() -> bool:
    """XPU graphs exist from torch 2.11 (``torch.xpu.XPUGraph``) and are on unless ``PAGEDLLM_XPU_GRAPHS=0``."""
    return (hasattr(getattr(torch, "xpu", None), "XPUGraph")
            and os.environ.get(GRAPHS_ENV, "1") not in ("", "0"))


@hookimpl
def pagedllm_backend_info() -> BackendInfo:
    return BackendInfo(name="xpu", device_type="xpu", priority=100, extra="xpu",
                       description="Intel GPUs (stock torch.xpu): Triton paged attention, XPU graphs for decode, xccl")


@hookimpl
def pagedllm_probe() -> ProbeResult:
    return xpu_probe.probe()


@hookimpl
def pagedllm_capabilities() -> Capabilities:
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    if torch.xpu.is_available() and not torch.xpu.is_bf16_supported():
        dtypes = ("float32", "float16")
    return Capabilities(dtypes=dtypes, kv_cache_dtypes=("auto",), head_sizes=HEAD_SIZES, block_sizes=BLOCK_SIZES,
                        graph_capture="decode" if graphs_enabled() else "none", sliding_window=True, soft_cap=True,
                        mla=True)  # canonical caches: core's reference MLA hooks run on them


@hookimpl
def pagedllm_update_config(config: Any, model_info: ModelInfo) -> Optional[dict]:
    """Arc A770 computes bfloat16 inaccurately (vllm/platforms/xpu.py ``check_if_supports_dtype`` refuses it):
    an explicit bfloat16 is refused with the fix, and a bfloat16 checkpoint under ``dtype=auto`` runs float16."""
    if not torch.xpu.is_available() or "a770" not in torch.xpu.get_device_name(0).lower():
        return None
    if config.dtype in ("bfloat16", "bf16"):
        raise ParamError("dtype", "Intel Arc A770 has a known bfloat16 accuracy issue; use --dtype float16")
    if config.dtype == "auto" and model_info.dtype == "bfloat16":
        return {"dtype": "float16"}
    return None


@hookimpl
def pagedllm_memory_info(device: torch.device) -> MemoryInfo:
    free, total = torch.xpu.mem_get_info(device)  # torch/xpu/memory.py: (free, total) bytes
    # vllm/platforms/xpu.py: is_pin_memory_available() is True on XPU
    return MemoryInfo(total_bytes=int(total), free_bytes=int(free), pinned_host=True)


@hookimpl
def pagedllm_memory_peak(device: torch.device) -> int:
    # vllm/platforms/xpu.py get_current_memory_usage: reset_peak_memory_stats + max_memory_allocated
    peak = torch.xpu.max_memory_allocated(device)
    torch.xpu.reset_peak_memory_stats(device)
    return int(peak)


@hookimpl
def pagedllm_distributed_backend() -> str:
    return "xccl"  # vllm/platforms/xpu.py: dist_backend = "xccl" (torch.distributed's XCCL, torch >= 2.8)


@hookimpl
def pagedllm_set_device(device: torch.device) -> None:
    torch.xpu.set_device(device)


@hookimpl
def pagedllm_synchronize(device: torch.device) -> None:
    torch.xpu.synchronize(device)


@hookimpl
def pagedllm_graph_runner(model: Any, max_num_seqs: int, device: torch.device, ctx: Any) -> GraphRunner:
    """Core's decode graph runner with ``torch.xpu`` as the device module and ``torch.xpu.XPUGraph`` as the graph:
    torch.xpu mirrors the torch.cuda names the runner uses (Stream, current_stream, stream, graph,
    graph_pool_handle)."""
    if not graphs_enabled():
        return GraphRunner(run=model, level="none", stats={"disabled_by": f"{GRAPHS_ENV}=0 or torch < 2.11"})
    from pagedllm.backend.graph_runner import make_graph_runner

    return make_graph_runner(model, max_num_seqs, device, ctx, api=torch.xpu, graph_cls=torch.xpu.XPUGraph)
