"""Can this machine run the ``rocm`` backend? A ROCm build of torch, the HIP runtime, a visible device, Triton.
The steps are core's (``pagedllm.backend.accelerator.probe_device``); the rules and words here are AMD's. ROCm builds
of torch drive AMD GPUs through torch's ``cuda`` device type, so a CUDA build must be told apart by its version info.
"""

from __future__ import annotations

import torch

from pagedllm.backend.accelerator import driver_problem, probe_device
from pagedllm.backend.hookspec import ProbeResult

DRIVER = "libamdhip64.so"
VISIBLE_ENV = "HIP_VISIBLE_DEVICES"


def build_problem() -> str:
    """Why this torch build cannot drive AMD GPUs, or '' when it can."""
    if getattr(torch.version, "hip", None):
        return ""
    cuda = getattr(torch.version, "cuda", None)
    kind = f"a CUDA {cuda} build (use the cuda backend)" if cuda else "built without ROCm/HIP support"
    return f"torch {torch.__version__} is {kind}: torch.version.hip is None; install a ROCm build of PyTorch"


def probe() -> ProbeResult:
    return probe_device("cuda", "ROCm", build_problem=build_problem,
                        unavailable=lambda: driver_problem("ROCm", DRIVER, VISIBLE_ENV))
