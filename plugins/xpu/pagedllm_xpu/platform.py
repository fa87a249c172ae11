"""Can this machine run the ``xpu`` backend? torch build, visible Intel GPU, Triton with an Intel backend.

Everything is read through stock ``torch.xpu`` (part of the torch wheel since 2.4) and the file system; no SYCL or
Level Zero library is loaded by hand and Triton is not imported. The steps are core's
(``pagedllm.backend.accelerator.probe_device``), the words here Intel's. Not verified on hardware.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from pagedllm.backend.accelerator import probe_device
from pagedllm.backend.hookspec import ProbeResult

#: Where the torch XPU wheels live (https://pytorch.org/docs/stable/notes/get_start_xpu.html).
XPU_WHEEL_INDEX = "https://download.pytorch.org/whl/xpu"


def _triton_reason() -> str:
    """'' when Triton can launch the kernels on an Intel GPU, else why not.

    torch's XPU wheels depend on ``pytorch-triton-xpu``, which installs the ``triton`` package with an
    ``backends/intel`` directory (intel/intel-xpu-backend-for-triton). A stock CUDA/ROCm Triton has no such backend.
    Under ``TRITON_INTERPRET=1`` no compiled backend is used at all.
    """
    spec = importlib.util.find_spec("triton")  # does not import triton
    if spec is None or not spec.submodule_search_locations:
        return (f"the Triton kernels need the `triton` package from pytorch-triton-xpu "
                f"(pip install torch --index-url {XPU_WHEEL_INDEX} brings it)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return ""
    if not any((Path(p) / "backends" / "intel").is_dir() for p in spec.submodule_search_locations):
        return ("the installed `triton` has no Intel XPU backend (triton/backends/intel); install pytorch-triton-xpu "
                f"(it comes with torch from {XPU_WHEEL_INDEX}) instead of a CUDA/ROCm Triton")
    return ""


def build_problem() -> str:
    """Why this torch cannot drive Intel GPUs at all, or ''."""
    if getattr(torch, "xpu", None) is None:
        return f"torch {torch.__version__} has no torch.xpu module (needs torch >= 2.4)"
    return ""


def unavailable() -> str:
    """Why torch.xpu sees no device: a torch built without XPU, or no visible device."""
    if not getattr(torch.xpu, "_is_compiled", lambda: True)():
        return (f"no Intel GPU: torch.xpu.is_available() is False (torch {torch.__version__} is built without XPU "
                f"support; install the XPU build: pip install torch --index-url {XPU_WHEEL_INDEX})")
    return ("no Intel GPU: torch.xpu.is_available() is False (XPU build of torch, but no device visible: check the "
            "Level Zero driver and ZE_AFFINITY_MASK)")


def probe() -> ProbeResult:
    """Never raises: the reason says what is missing, most fundamental first (core's steps, Intel's words)."""
    return probe_device("xpu", "XPU", build_problem=build_problem, unavailable=unavailable,
                        triton_problem=_triton_reason)
