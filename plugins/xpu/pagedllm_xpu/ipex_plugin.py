"""The ``ipex`` backend: Intel CPUs through intel-extension-for-pytorch's paged-attention ops.

A separate backend name rather than an option of ``cpu`` or ``xpu``: it has its own KV layout and kernels, its own
install story (an IPEX wheel matching torch's major.minor, never pulled in by pip), and ``pagedllm backends`` can
say precisely why it is not usable. It is picked by ``--device ipex``, or by ``auto`` over ``cpu`` when usable.
Loading this module never imports IPEX: the probe checks the installed version first (:mod:`pagedllm_xpu.vendor`).
Not verified on hardware.
"""

from __future__ import annotations

import os

import torch

from pagedllm.backend.hookspec import BackendInfo, Capabilities, MemoryInfo, ProbeResult, hookimpl
from pagedllm_xpu import vendor
from pagedllm_xpu.ipex_ops import (pagedllm_allocate_host_kv_cache, pagedllm_allocate_kv_cache,  # noqa: F401
                                   pagedllm_gather_kv_blocks, pagedllm_paged_attention, pagedllm_swap_kv_blocks,
                                   pagedllm_write_kv)

#: KV budget when the user gives none: vLLM CPU's VLLM_CPU_KVCACHE_SPACE default (4 GiB); RAM is shared.
DEFAULT_KV_BYTES = 4 << 30


@hookimpl
def pagedllm_backend_info() -> BackendInfo:
    return BackendInfo(name="ipex", device_type="cpu", priority=20, extra="xpu",
                       description="Intel CPUs with intel-extension-for-pytorch: ipex.llm.modules.PagedAttention")


@hookimpl
def pagedllm_probe() -> ProbeResult:
    status = vendor.check()
    if not status.ok:
        return ProbeResult(False, status.reason)
    try:
        vendor.load()
    except vendor.IpexUnavailable as e:
        return ProbeResult(False, str(e))
    return ProbeResult(True, "", f"host CPU, {vendor.DIST} {status.version}")


@hookimpl
def pagedllm_capabilities() -> Capabilities:
    # vllm/v1/attention/backends/cpu_attn.py: _IPEXPagedAttention.validate_head_size accepts any head size;
    # IPEX CPU kernels run float32 and bfloat16.
    return Capabilities(dtypes=("float32", "bfloat16"), kv_cache_dtypes=("auto",), head_sizes=None,
                        block_sizes=(16, 32, 64, 128), graph_capture="none", sliding_window=False, soft_cap=False,
                        mla=True)  # canonical caches: core's reference MLA hooks run on them


@hookimpl
def pagedllm_memory_info(device: torch.device) -> MemoryInfo:
    page = os.sysconf("SC_PAGE_SIZE")
    total, free = page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")
    return MemoryInfo(total_bytes=total, free_bytes=min(free, total), pinned_host=False,
                      default_kv_bytes=DEFAULT_KV_BYTES)
