"""The ``rocm`` backend: AMD GPUs through torch's device module (``cuda`` on ROCm builds of torch), core's portable
Triton kernels, HIP graphs for decode, rccl (torch.distributed names it nccl).

Only the identity (below) and the probe (:mod:`pagedllm_rocm.platform`) are AMD's; everything else is core's
device-generic GPU code: the Triton op hooks and ``pagedllm.backend.accelerator.DeviceHooks``, shared with the cuda
and xpu backends. Loading this module imports neither Triton nor any HIP library.
"""

from pagedllm.backend.accelerator import DeviceHooks
from pagedllm.backend.hookspec import BackendInfo
from pagedllm.backend.triton import CAPABILITIES
from pagedllm.backend.triton.hooks import (pagedllm_paged_attention, pagedllm_rms_norm,  # noqa: F401
                                           pagedllm_rotary, pagedllm_silu_and_mul, pagedllm_write_kv)
from pagedllm_rocm import platform

INFO = BackendInfo(name="rocm", device_type="cuda", priority=100, extra="rocm",
                   description="AMD GPUs: Triton paged attention, HIP graphs for decode, rccl (torch name nccl)")
HOOKS = DeviceHooks(INFO, platform.probe, distributed_backend="nccl", capabilities=CAPABILITIES)
globals().update(HOOKS.hookimpls())  # pluggy reads hooks from module attributes: pagedllm_probe, ...
