"""The CPU plugin's GGUF Q8_0 kernel (``pagedllm_cpu/csrc/q8_gemv.cpp``, reading the blocks as stored) against core's
reference (the blocks dequantized with ``gguf.quants``, then an fp64 matmul): odd output widths, several K, one row,
the 8-row tile and a remainder (13 = 8 + 5), blocks with a row stride (a slice of a wider table), reduced-dtype
activations; and the hook offering it only once the library is loaded."""

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


def _weight(n: int, k: int) -> QuantizedWeight:
    blocks = random_blocks("Q8_0", n, k, np.random.default_rng(n * k))
    return QuantizedWeight("gguf", "Q8_0", torch.from_numpy(blocks), (n, k))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [(1,), (8,), (13,)])
def test_gemv_matches_fp64_reference(lib, n, k, rows):
    w = _weight(n, k)
    kernel = quant.quantized_linear("gguf", "Q8_0")
    assert kernel is quant.Q8
    state = kernel.prepare(w, torch.float32, "cpu")
    assert state.data_ptr() == w.data.data_ptr()  # the blocks as given, not a copy
    x = torch.randn(*rows, k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    expected = torch.nn.functional.linear(x.double(), dequantize(w).double(), bias.double())
    got = kernel.apply(state, x, bias)
    assert got.dtype == torch.float32 and got.shape == (*rows, n)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_gemv_reads_strided_rows(lib):
    """Rows of a wider table (a column slice): the row stride is honoured, the bytes within a row read in place."""
    w = _weight(21, 96)
    wide = torch.cat([w.data, torch.full((21, 7), 0x7F, dtype=torch.uint8)], dim=1)[:, :w.data.shape[1]]
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    expected = x.double() @ dequantize(w).double().T
    torch.testing.assert_close(lib.q8_gemv(x, wide).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_of_reduced_dtypes_rounds_the_fp32_result(lib, dtype):
    w = _weight(40, 96)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = quant.Q8.apply(quant.Q8.prepare(w, dtype, "cpu"), x, None)
    assert got.dtype == dtype
    torch.testing.assert_close(got, lib.q8_gemv(x.float(), w.data).to(dtype), rtol=0, atol=0)


def test_hook_offers_q8_only_with_the_library(monkeypatch, lib):
    monkeypatch.setattr(native, "lib", None)
    assert quant.quantized_linear("gguf", "Q8_0") is None  # core's reference then: the kernel has no torch path


def test_gemv_reads_every_kind_of_fp16_scale(lib):
    """Subnormal, signed-zero, negative and the largest finite fp16 scales dequantize as ``gguf.quants`` does."""
    w = _weight(8, 64)
    blocks = w.data.view(8, 2, 34).clone()
    scales = torch.tensor([0x0001, 0x03FF, 0x8000, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x2E66, 0xA1D5, 0x0200,
                           0x8001, 0x1400, 0x9400, 0x3555, 0x4000], dtype=torch.int32).to(torch.int16)
    blocks[:, :, :2] = scales.view(8, 2, 1).view(torch.uint8)
    w = QuantizedWeight("gguf", "Q8_0", blocks.reshape(8, 68), (8, 64))
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)) * 1e-3
    expected = x.double() @ dequantize(w).double().T
    torch.testing.assert_close(lib.q8_gemv(x, w.data).double(), expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())
