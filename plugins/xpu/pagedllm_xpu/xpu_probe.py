"""Can this machine run the ``xpu`` backend? torch build, visible Intel GPU, Triton with an Intel backend.

Everything is read through stock ``torch.xpu`` (part of the torch wheel since 2.4) and the file system; no SYCL or
Level Zero library is loaded by hand and Triton is not imported. Not verified on hardware.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

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


def probe() -> ProbeResult:
    """Never raises: the reason says what is missing, most fundamental first."""
    try:
        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return ProbeResult(False, f"torch {torch.__version__} has no torch.xpu module (needs torch >= 2.4)")
        if not xpu.is_available():
            compiled = getattr(xpu, "_is_compiled", lambda: True)()
            if not compiled:
                return ProbeResult(False, f"no Intel GPU: torch.xpu.is_available() is False (torch "
                                          f"{torch.__version__} is built without XPU support; install the XPU "
                                          f"build: pip install torch --index-url {XPU_WHEEL_INDEX})")
            return ProbeResult(False, "no Intel GPU: torch.xpu.is_available() is False (XPU build of torch, but no "
                                      "device visible: check the Level Zero driver and ZE_AFFINITY_MASK)")
        count = xpu.device_count()
        name = xpu.get_device_name(0)  # vllm/platforms/xpu.py: XPUPlatform.get_device_name
        reason = _triton_reason()
        if reason:
            return ProbeResult(False, reason, name)
        return ProbeResult(True, "", f"{name} x{count}")
    except Exception as e:  # a probe never raises
        return ProbeResult(False, f"XPU probe failed: {type(e).__name__}: {e}")
