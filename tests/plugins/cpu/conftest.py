"""Fixtures of the CPU plugin's kernel tests."""

from __future__ import annotations

import pytest

BUILD_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def lib():
    """``torch.ops.pagedllm_cpu`` once the plugin's C++ library is built and loaded (the first build takes ~1 min)."""
    from pagedllm_cpu import native

    assert native.get(wait=True, timeout=BUILD_TIMEOUT_S) is not None, f"the library did not build: {native.error()}"
    return native.lib
