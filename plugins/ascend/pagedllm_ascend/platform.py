"""Platform facts for the probe: is an Ascend NPU usable here? Answered without importing torch-npu until the CANN
runtime is known to exist: torch-npu imported without CANN breaks ``import torch`` itself, so the probe looks before
it leaps."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
from typing import Optional

import torch

from pagedllm.backend.hookspec import ProbeResult

#: Where CANN's set_env.sh points (ASCEND_HOME_PATH, ASCEND_TOOLKIT_HOME) and its default install prefix.
CANN_ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
CANN_DEFAULT_DIR = "/usr/local/Ascend"
INSTALL_HINT = "pip install torch-npu=={}.* and the CANN toolkit"


def _torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def cann_home() -> Optional[str]:
    """The CANN install this process would load, or None: an existing folder named by CANN's environment
    variables, else the default prefix."""
    for var in CANN_ENV_VARS:
        path = os.environ.get(var)
        if path and os.path.isdir(path):
            return path
    return CANN_DEFAULT_DIR if os.path.isdir(CANN_DEFAULT_DIR) else None


def version_mismatch() -> str:
    """Why the installed torch-npu distribution cannot work with this torch ('' when it can or is unknown):
    torch-npu X.Y only runs on torch X.Y. Read from package metadata, without importing torch-npu."""
    try:
        npu_version = md.version("torch-npu")
    except md.PackageNotFoundError:
        return ""  # a torch_npu module without distribution metadata: judged when imported
    npu_minor = ".".join(npu_version.split("+")[0].split(".")[:2])
    if npu_minor != _torch_minor():
        return (f"torch-npu {npu_version} needs torch {npu_minor}, this is torch {torch.__version__} "
                f"({INSTALL_HINT.format(_torch_minor())})")
    return ""


def probe() -> ProbeResult:
    """torch-npu present, matching torch, CANN found, torch-npu importable, a device visible; never raises."""
    try:
        if importlib.util.find_spec("torch_npu") is None:
            return ProbeResult(False, f"torch-npu not installed ({INSTALL_HINT.format(_torch_minor())})")
        mismatch = version_mismatch()
        if mismatch:
            return ProbeResult(False, mismatch)
        home = cann_home()
        if home is None:
            return ProbeResult(False, "torch-npu is installed but no CANN runtime was found (ASCEND_HOME_PATH / "
                                      f"ASCEND_TOOLKIT_HOME unset and no {CANN_DEFAULT_DIR}); source CANN's "
                                      "set_env.sh. torch_npu was not imported: without CANN it breaks torch")
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except Exception as e:
            return ProbeResult(False, f"torch_npu failed to import with CANN at {home}: {type(e).__name__}: {e}")
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available() or npu.device_count() == 0:
            return ProbeResult(False, f"torch-npu and CANN ({home}) load but no NPU is visible (check npu-smi info "
                                      "and ASCEND_RT_VISIBLE_DEVICES)")
        version = getattr(torch_npu, "__version__", "?")
        return ProbeResult(True, f"torch-npu {version}, CANN at {home}",
                           f"{npu.get_device_name(0)} x{npu.device_count()}")
    except Exception as e:  # a probe never raises
        return ProbeResult(False, f"Ascend probe failed: {type(e).__name__}: {e}")
