"""The one place the Gaudi software stack (``habana_frameworks``) is imported, lazily.

Loading the plugin imports nothing from the vendor: ``import habana_frameworks.torch`` loads the Gaudi PyTorch
bridge, which needs Intel's own torch build and the driver, and on a mismatched install can fail or abort. The probe
first asks ``importlib.util.find_spec`` whether the package exists at all, and only then imports it, inside a try.

Fake-HPU mode (``VLLM_USE_FAKE_HPU=1``, the name and meaning vllm-gaudi uses: vllm_gaudi/extension/utils.py
``is_fake_hpu``) runs the same plugin code on host tensors (device ``cpu``): the tests use it with a simulated
``habana_frameworks`` package, because torch's ``hpu`` device type is built in (``torch.device("hpu")`` parses
to ``DeviceType::HPU``, not to the PrivateUse1 slot), so renaming torch's Python PrivateUse1 backend to ``hpu``
does not give ``hpu`` tensors without Intel's bridge.

Not verified on hardware.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from functools import lru_cache
from types import ModuleType

INSTALL_HINT = "Intel Gaudi software stack; see docs/backends/gaudi.md"


def fake_hpu() -> bool:
    """vllm-gaudi's ``is_fake_hpu()`` (vllm_gaudi/extension/utils.py): run the HPU path on the CPU."""
    return os.environ.get("VLLM_USE_FAKE_HPU", "0") not in ("", "0")


def device_type() -> str:
    return "cpu" if fake_hpu() else "hpu"


def installed() -> bool:
    try:
        return importlib.util.find_spec("habana_frameworks") is not None
    except (ImportError, ValueError):
        return False


@lru_cache(maxsize=1)
def htorch() -> ModuleType:
    """``habana_frameworks.torch`` (imported on first use; raises ImportError when absent)."""
    return importlib.import_module("habana_frameworks.torch")


def hpu() -> ModuleType:
    """``habana_frameworks.torch.hpu``: devices, memory, streams, HPU graphs."""
    return importlib.import_module("habana_frameworks.torch.hpu")


def mark_step() -> None:
    """Flush the lazy-mode op accumulation into one graph launch.
    API: ``habana_frameworks.torch.core.mark_step()`` (vllm-gaudi: vllm_gaudi/v1/worker/hpu_model_runner.py)."""
    htorch().core.mark_step()


def is_lazy() -> bool:
    """Lazy mode (``PT_HPU_LAZY_MODE=1``) vs eager/torch.compile; vllm-gaudi asks
    ``htorch.utils.internal.is_lazy()`` (vllm_gaudi/v1/worker/hpu_model_runner.py ``_maybe_wrap_in_hpu_graph``)."""
    return bool(importlib.import_module("habana_frameworks.torch.utils.internal").is_lazy())
