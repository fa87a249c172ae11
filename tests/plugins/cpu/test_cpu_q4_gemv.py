"""The CPU plugin's GGUF Q4_0 / Q4_1 kernel (``pagedllm_cpu/csrc/q4_gemv.cpp``) against core's reference (the blocks
dequantized with ``gguf.quants``, then an fp32 matmul): odd output widths (a zero-padded last group of 16 rows),
several K, one row, the 8-row tile and a remainder, reduced-dtype activations; and the torch fallback's dequantize
of the repacked layout, which must be exact; and the path taken before the library is loaded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.quantization import dequantize
from pagedllm.quantization.gguf import random_blocks
from pagedllm_cpu import native, quant
from int8_act import use_int8_activations

SHAPES = [(37, 64), (96, 576), (19, 1536)]  # (out, in)  ("lib": tests/plugins/cpu/conftest.py)


@pytest.fixture(autouse=True)
def fp32_kernels(monkeypatch):
    """The fp32 kernels, held to fp32 tolerance: decodes' int8 activations (``q8act_gemv``, tested in
    test_int8_act_gemv.py) off."""
    use_int8_activations(monkeypatch, False)


def _weight(qtype: str, n: int, k: int) -> QuantizedWeight:
    blocks = random_blocks(qtype, n, k, np.random.default_rng(n * k))
    return QuantizedWeight("gguf", qtype, torch.from_numpy(blocks), (n, k))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_repacked_layout_dequantizes_exactly(qtype, n, k):
    w = _weight(qtype, n, k)
    state = quant._prepare(w, torch.float32, "cpu")
    assert state.packed.numel() == -(-n // 16) * 16 * w.data.shape[1]  # the GGUF bytes, rows padded to 16
    torch.testing.assert_close(quant._dequantize(state.packed, n, state.has_min), dequantize(w).float(), rtol=0,
                               atol=0)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [(1,), (8,), (3, 5)])  # 15 rows: tiles of 8 and 7
def test_gemv_matches_fp32_reference(lib, qtype, n, k, rows):
    w = _weight(qtype, n, k)
    state = quant._prepare(w, torch.float32, "cpu")
    x = torch.randn(*rows, k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    expected = torch.nn.functional.linear(x.double(), dequantize(w).double(), bias.double())
    got = quant._apply(state, x, bias)
    assert got.dtype == torch.float32 and got.shape == (*rows, n)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_of_reduced_dtypes_rounds_the_fp32_result(lib, dtype):
    w = _weight("Q4_1", 40, 96)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = quant._apply(quant._prepare(w, dtype, "cpu"), x, None)
    expected = (x.float() @ dequantize(w).float().T).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("n", [96, 37])  # torch's int4 kernel; dense where it cannot take the shape
def test_path_before_the_library_is_loaded(monkeypatch, qtype, n):
    """Until the library is loaded: torch's int4 kernel (bf16 activations and scales) on a copy made from the
    repacked blocks at the first call, or dense fp32 where N is not a multiple of 16."""
    monkeypatch.setattr(native, "lib", None)
    w = _weight(qtype, n, 576)
    state = quant._prepare(w, torch.float32, "cpu")
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(1))
    expected = x @ dequantize(w).float().T
    got = quant._apply(state, x, None)
    assert (state.int4pack is not None) == (n % 16 == 0)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < (1e-2 if n % 16 == 0 else 1e-6), rel
