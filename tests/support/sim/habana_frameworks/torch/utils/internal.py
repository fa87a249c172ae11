"""Simulated ``habana_frameworks.torch.utils.internal``: lazy mode follows ``PT_HPU_LAZY_MODE`` (default 1)."""

import os


def is_lazy() -> bool:
    return os.environ.get("PT_HPU_LAZY_MODE", "1") == "1"
