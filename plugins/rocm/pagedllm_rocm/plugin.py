"""The ``rocm`` backend: core's portable Triton kernels plus the shared torch.cuda hooks (memory, HIP graphs, rccl).

ROCm builds of torch expose AMD GPUs as torch device type ``cuda``, so everything but identity and probe is shared
with the cuda backend (``pagedllm.backend.triton``); loading this module imports neither Triton nor any HIP library.
"""

from pagedllm.backend.hookspec import BackendInfo, ProbeResult, hookimpl
from pagedllm.backend import accelerator as torch_cuda
from pagedllm.backend.triton.hooks import (pagedllm_paged_attention, pagedllm_rms_norm,  # noqa: F401
                                         pagedllm_rotary, pagedllm_silu_and_mul, pagedllm_write_kv)
from pagedllm.backend.accelerator import (pagedllm_capabilities, pagedllm_distributed_backend,  # noqa: F401
                                         pagedllm_graph_runner, pagedllm_memory_info, pagedllm_memory_peak,
                                         pagedllm_set_device, pagedllm_synchronize)


@hookimpl
def pagedllm_backend_info() -> BackendInfo:
    return BackendInfo(name="rocm", device_type="cuda", priority=100, extra="rocm",
                       description="AMD GPUs: Triton paged attention, HIP graphs for decode, rccl (torch name nccl)")


@hookimpl
def pagedllm_probe() -> ProbeResult:
    return torch_cuda.probe("rocm")
