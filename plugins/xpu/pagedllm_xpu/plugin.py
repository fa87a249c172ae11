"""The ``xpu`` backend: Intel GPUs through stock ``torch.xpu``, core's portable Triton kernels, XPU graphs, xccl.

The op hooks are core's Triton kernels (``pagedllm.backend.triton.hooks``; Triton compiles them for Intel GPUs through
pytorch-triton-xpu) and the runtime hooks core's device-generic GPU code (``pagedllm.backend.accelerator.DeviceHooks``
on torch's ``xpu`` device module), as the cuda and rocm backends use them. What is Intel's own: the identity, the
probe (:mod:`pagedllm_xpu.platform`), the ``PAGEDLLM_XPU_GRAPHS`` gate, xccl, the capabilities left undeclared until
verified here (fp8 KV, ALiBi) and the Arc A770 bfloat16 rule. Every torch.xpu call is looked up when the hook runs,
never at import: loading this module imports neither Triton nor any Intel runtime library. Not verified on hardware.

Sources for the calls: vllm/platforms/xpu.py (``dist_backend = "xccl"``, ``torch.xpu.set_device``,
``get_device_name``, ``is_pin_memory_available() -> True``, ``max_memory_allocated`` + ``reset_peak_memory_stats``
for the profiling run, XPU graphs supported from torch 2.11 by ``supports_xpu_graph``); torch 2.13's
``torch/xpu/graphs.py`` (``XPUGraph``, ``graph(xpu_graph, pool, stream)``, ``graph_pool_handle``) and
``torch/xpu/memory.py`` (``mem_get_info(device) -> (free, total)``).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Optional

import torch

from pagedllm.backend import ParamError
from pagedllm.backend.accelerator import DeviceHooks
from pagedllm.backend.hookspec import BackendInfo, ModelInfo, hookimpl
from pagedllm.backend.triton import CAPABILITIES
from pagedllm.backend.triton.hooks import (pagedllm_paged_attention, pagedllm_rms_norm,  # noqa: F401
                                           pagedllm_rotary, pagedllm_silu_and_mul, pagedllm_write_kv)
from pagedllm_xpu import platform

#: Set to 0 to run eagerly (core's PAGEDLLM_DISABLE_GRAPHS=1 also does); vLLM gates XPU graphs the same way
#: (VLLM_XPU_ENABLE_XPU_GRAPH) because they are new in torch (``torch.xpu.XPUGraph``, torch >= 2.11: core turns
#: graphs off when the class is missing).
GRAPHS_ENV = "PAGEDLLM_XPU_GRAPHS"


def graphs_off() -> str:
    """Why XPU graphs are off by this plugin's gate, '' when it leaves them on (the default)."""
    return f"{GRAPHS_ENV}=0" if os.environ.get(GRAPHS_ENV, "1") in ("", "0") else ""


INFO = BackendInfo(name="xpu", device_type="xpu", priority=100, extra="xpu",
                   description="Intel GPUs (stock torch.xpu): Triton paged attention, XPU graphs for decode, xccl")
# xccl: torch.distributed's XCCL, torch >= 2.8 (vllm/platforms/xpu.py: dist_backend = "xccl").
HOOKS = DeviceHooks(INFO, platform.probe, distributed_backend="xccl", graphs_off=graphs_off,
                    capabilities=replace(CAPABILITIES, kv_cache_dtypes=("auto",), alibi=False))
globals().update(HOOKS.hookimpls())  # pluggy reads hooks from module attributes: pagedllm_probe, ...


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
