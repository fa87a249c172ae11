"""Hooks shared by every backend that drives its device through the ``torch.cuda`` API (NVIDIA CUDA, AMD ROCm/HIP).

A plugin module for such a device re-exports these hooks and the Triton op hooks (``ops_plugin``) and adds only its
identity (``pagedllm_backend_info``) and a probe built with :func:`probe`. No vendor SDK is imported here: everything
goes through torch, and Triton loads on the first kernel call.
"""

from __future__ import annotations

import ctypes
import importlib.util
from typing import Any

import torch

from pagedllm.backend.hookspec import Capabilities, GraphRunner, MemoryInfo, ProbeResult, hookimpl

HEAD_SIZES = (32, 64, 80, 96, 128, 256)
BLOCK_SIZES = (16, 32)
_VENDOR = {"cuda": ("CUDA", "libcuda.so.1", "CUDA_VISIBLE_DEVICES"),
           "rocm": ("ROCm", "libamdhip64.so", "HIP_VISIBLE_DEVICES")}


def _build_mismatch(flavor: str) -> str:
    """Why this torch build cannot drive ``flavor`` devices, or '' when it can."""
    hip = getattr(torch.version, "hip", None)
    cuda = getattr(torch.version, "cuda", None)
    if flavor == "cuda":
        if hip:
            return (f"torch {torch.__version__} is a ROCm/HIP build (torch.version.hip={hip}), not a CUDA build; "
                    "use the rocm backend (pip install pagedllm[rocm])")
        if not cuda:
            return (f"torch {torch.__version__} was built without CUDA support (torch.version.cuda is None); "
                    "install a CUDA build of PyTorch")
    else:
        if not hip:
            kind = f"a CUDA {cuda} build (use the cuda backend)" if cuda else "built without ROCm/HIP support"
            return (f"torch {torch.__version__} is {kind}: torch.version.hip is None; "
                    "install a ROCm build of PyTorch")
    return ""


def probe(flavor: str) -> ProbeResult:
    """Probe for ``flavor`` in (``cuda``, ``rocm``): torch build, driver, visible device, compute capability, Triton."""
    vendor, driver_lib, visible_env = _VENDOR[flavor]
    try:
        mismatch = _build_mismatch(flavor)
        if mismatch:
            return ProbeResult(False, mismatch)
        if not torch.cuda.is_available():
            try:
                ctypes.CDLL(driver_lib)
            except OSError:
                return ProbeResult(False, f"no {vendor} driver: {driver_lib} cannot be loaded")
            return ProbeResult(False, f"{vendor} driver found but no device is visible (check {visible_env})")
        major, minor = torch.cuda.get_device_capability(0)
        name = torch.cuda.get_device_name(0)
        if flavor == "cuda" and (major, minor) < (7, 5):
            return ProbeResult(False, f"{name} has compute capability {major}.{minor}; the Triton kernels need >= 7.5",
                               name)
        if importlib.util.find_spec("triton") is None:
            return ProbeResult(False, "the Triton kernels need the `triton` package (pip install triton)", name)
        return ProbeResult(True, "", f"{name} x{torch.cuda.device_count()}")
    except Exception as e:  # a probe never raises
        return ProbeResult(False, f"{vendor} probe failed: {type(e).__name__}: {e}")


@hookimpl
def pagedllm_capabilities() -> Capabilities:
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        dtypes = ("float32", "float16")
    # fp8 KV: stored as bytes, encoded/decoded in integer arithmetic by the Triton kernels (kernels/fp8.py)
    return Capabilities(dtypes=dtypes, kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"), head_sizes=HEAD_SIZES, block_sizes=BLOCK_SIZES,
                        graph_capture="decode", sliding_window=True, soft_cap=True, alibi=True,
                        mla=True)  # canonical caches: core's reference MLA hooks run on them


@hookimpl
def pagedllm_memory_info(device: torch.device) -> MemoryInfo:
    free, total = torch.cuda.mem_get_info(device)
    return MemoryInfo(total_bytes=total, free_bytes=free, pinned_host=True)


@hookimpl
def pagedllm_distributed_backend() -> str:
    return "nccl"  # torch's name for NCCL, and for RCCL on ROCm builds


@hookimpl
def pagedllm_set_device(device: torch.device) -> None:
    torch.cuda.set_device(device)


@hookimpl
def pagedllm_synchronize(device: torch.device) -> None:
    torch.cuda.synchronize(device)


@hookimpl
def pagedllm_graph_runner(model: Any, max_num_seqs: int, device: torch.device, ctx: Any) -> GraphRunner:
    from pagedllm.backend.graph_runner import make_graph_runner

    return make_graph_runner(model, max_num_seqs, device, ctx)


@hookimpl
def pagedllm_memory_peak(device: torch.device) -> int:
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


__all__ = ["pagedllm_capabilities", "pagedllm_memory_info", "pagedllm_memory_peak", "pagedllm_distributed_backend",
           "pagedllm_set_device", "pagedllm_synchronize", "pagedllm_graph_runner"]
