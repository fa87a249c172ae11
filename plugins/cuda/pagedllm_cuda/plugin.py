"""The ``cuda`` backend: NVIDIA GPUs through torch's ``cuda`` device module, core's portable Triton kernels, CUDA
graphs for decode, nccl.

Only the identity (below) and the probe (:mod:`pagedllm_cuda.platform`) are NVIDIA's; the op hooks are core's Triton
kernels (``pagedllm.backend.triton.hooks``) and the runtime hooks core's device-generic GPU code
(``pagedllm.backend.accelerator.DeviceHooks``), shared with the rocm and xpu backends. Loading this module imports
neither Triton nor any CUDA library.
"""

from pagedllm.backend.accelerator import DeviceHooks
from pagedllm.backend.hookspec import BackendInfo
from pagedllm.backend.triton import CAPABILITIES
from pagedllm.backend.triton.hooks import (pagedllm_paged_attention, pagedllm_rms_norm,  # noqa: F401
                                           pagedllm_rotary, pagedllm_silu_and_mul, pagedllm_write_kv)
from pagedllm_cuda import platform

INFO = BackendInfo(name="cuda", device_type="cuda", priority=100, extra="cuda",
                   description="NVIDIA GPUs: Triton paged attention, CUDA graphs for decode, nccl")
HOOKS = DeviceHooks(INFO, platform.probe, distributed_backend="nccl", capabilities=CAPABILITIES)
globals().update(HOOKS.hookimpls())  # pluggy reads hooks from module attributes: pagedllm_probe, ...
