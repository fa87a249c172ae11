"""Shared fixtures: tiny random HF models built once per session, and a reference-ops-only backend.

The test folders mirror the packages (core, models, server, distributed, cli, bench, plugins/<name>); the helpers
they share and the simulated vendor SDKs live in tests/support/, which goes on sys.path here."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))  # tests/support: `import tiny_models`, ...

import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when it is first imported, and plugin discovery in any earlier test may import it
# (the xpu plugin loads core's Triton kernels): without an accelerator, every in-process Triton use is interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tiny_models  # noqa: E402
from pagedllm.backend.hookspec import BackendInfo, MemoryInfo, ProbeResult, hookimpl  # noqa: E402

@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """Every tiny model of ``tiny_models.TINY_MODEL_SPECS``, saved once: name -> folder."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: tiny_models.make_tiny_model(arch, root / name, **kw)
            for name, (arch, kw) in tiny_models.TINY_MODEL_SPECS.items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def smollm2_hf():
    """HF transformers' float32 model of the embedded SmolLM2 GGUF (transformers dequantizes the file: ~12 s of CPU),
    loaded once for every test that takes it as its oracle. Read-only: forwards, ``generate`` and ``state_dict``."""
    from transformers import AutoModelForCausalLM

    from pagedllm.models import resolve_model_path

    path = resolve_model_path(None)
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def bench_llama(tmp_path_factory) -> str:
    """DESIGN.md's ~19M-parameter benchmark Llama."""
    return tiny_models.make_bench_llama(tmp_path_factory.mktemp("bench_llama"))


class RefOnlyPlugin:
    """A backend implementing only the required hooks, so every op is core's reference implementation."""

    @hookimpl
    def pagedllm_backend_info(self):
        return BackendInfo(name="ref", device_type="cpu")

    @hookimpl
    def pagedllm_probe(self):
        return ProbeResult(usable=True, device_name="cpu (reference ops)")

    @hookimpl
    def pagedllm_memory_info(self, device):
        return MemoryInfo(total_bytes=8 << 30, free_bytes=4 << 30)


@pytest.fixture(scope="session")
def ref_backend():
    """``pagedllm.backend.registry.Backend`` over ``RefOnlyPlugin`` (reference ops everywhere), not registered globally."""
    from pagedllm.backend.registry import Backend

    return Backend(RefOnlyPlugin(), "ref-test")
