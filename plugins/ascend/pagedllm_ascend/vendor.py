"""The one place torch-npu is imported, lazily: loading the plugin (``pagedllm backends``) must import nothing
vendor, and the probe decides first whether importing it is safe (see ``platform.py``)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch


@lru_cache(maxsize=1)
def torch_npu() -> Any:
    """The ``torch_npu`` module (importing it registers the ``npu`` device and ``torch.npu``)."""
    import torch_npu as mod

    return mod


def npu() -> Any:
    """``torch.npu``, the device module torch-npu registers (mem_get_info, synchronize, NPUGraph...)."""
    torch_npu()
    return torch.npu  # type: ignore[attr-defined]
