"""Can this machine run the ``cuda`` backend? A CUDA build of torch, the driver, a visible device of compute
capability 7.5 or newer, Triton. The steps are core's (``pagedllm.backend.accelerator.probe_device``); the rules and
words here are NVIDIA's. Nothing is imported from a CUDA library: torch answers, and the driver is only opened by
name when torch sees no device, to say which of the two is missing.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.backend.accelerator import driver_problem, probe_device
from pagedllm.backend.hookspec import ProbeResult

DRIVER = "libcuda.so.1"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
#: The oldest compute capability the Triton kernels run on.
MIN_CAPABILITY = (7, 5)


def build_problem() -> str:
    """Why this torch build cannot drive NVIDIA GPUs, or '' when it can."""
    hip = getattr(torch.version, "hip", None)
    if hip:
        return (f"torch {torch.__version__} is a ROCm/HIP build (torch.version.hip={hip}), not a CUDA build; "
                "use the rocm backend (pip install pagedllm[rocm])")
    if not getattr(torch.version, "cuda", None):
        return (f"torch {torch.__version__} was built without CUDA support (torch.version.cuda is None); "
                "install a CUDA build of PyTorch")
    return ""


def capability_problem(cuda: Any, name: str) -> str:
    """Why device 0 is too old for the Triton kernels, or ''."""
    major, minor = cuda.get_device_capability(0)
    if (major, minor) < MIN_CAPABILITY:
        need = ".".join(map(str, MIN_CAPABILITY))
        return f"{name} has compute capability {major}.{minor}; the Triton kernels need >= {need}"
    return ""


def probe() -> ProbeResult:
    return probe_device("cuda", "CUDA", build_problem=build_problem, device_problem=capability_problem,
                        unavailable=lambda: driver_problem("CUDA", DRIVER, VISIBLE_ENV))
