"""The CPU plugin's C++ elementwise ops (``pagedllm_cpu/csrc/rms_norm.cpp``, ``rotary.cpp``, ``silu_and_mul.cpp``,
``write_kv.cpp``)
against core's reference ops, through the backend's hooks, on odd shapes and the strided views the decoder passes
(q/k/v split out of one fused qkv). The library must build here (g++ is on the CI image), as for the decode kernel.
"""

from __future__ import annotations

import pytest
import torch

import pagedllm.backend.registry as backends
from pagedllm.backend import ref_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def cpu(lib) -> backends.Backend:
    """The CPU backend with its C++ library loaded (``lib``: tests/plugins/cpu/conftest.py)."""
    return backends.get_backend("cpu")


def tol(dtype: torch.dtype) -> dict:
    """float32: the sum of squares is accumulated in another order than torch's; reduced dtypes round the same
    float32 values, so they match exactly."""
    return dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 577), (13, 96), (3, 5, 40)])
def test_rms_norm_matches_reference(cpu, dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-6), ref_ops.rms_norm(x, w, 1e-6), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (64, 2 * 1024), (5, 2 * 37)])
def test_silu_and_mul_matches_reference(cpu, lib, dtype, shape):
    """One C++ pass (ATen's exp_u20, not torch's Sleef exp): float32 within a few ulp; bfloat16 rounds the same
    values exactly; float16 within one of its ulp. Rows with a stride (a gate_up slice of a wider buffer) too."""
    g = torch.Generator().manual_seed(3)
    x = (4 * torch.randn(shape[0], shape[1] + 6, generator=g)).to(dtype)[:, 3:3 + shape[1]]
    want = ref_ops.silu_and_mul(x)
    got = cpu.silu_and_mul(x)
    assert got.shape == want.shape and got.dtype == dtype
    tols = {torch.float32: dict(atol=1e-6, rtol=2e-6), torch.bfloat16: dict(atol=0, rtol=0),
            torch.float16: dict(atol=1e-3, rtol=2e-3)}
    torch.testing.assert_close(got, want, **tols[dtype])
    assert torch.equal(got, lib.silu_and_mul(x))  # the hook took the C++ op


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_heads_split_from_qkv(cpu, dtype):
    """q/k norms (Qwen3, Gemma 3) get ``[T, H, D]`` views whose rows are not evenly strided."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, 5 * 48 + 2 * 48, generator=g).to(dtype)
    q = qkv[:, :5 * 48].view(7, 5, 48)
    w = (1 + 0.2 * torch.randn(48, generator=g)).to(dtype)
    torch.testing.assert_close(cpu.rms_norm(q, w, 1e-5), ref_ops.rms_norm(q, w, 1e-5), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 11])
def test_fused_add_rms_norm_matches_reference(cpu, dtype, rows):
    """The sum is rounded to the dtype and written into x exactly as ``x.add_(residual)``; residual is untouched."""
    g = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(rows, 200, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.2 * torch.randn(200, generator=g)).to(dtype)
    want_norm, want_sum = ref_ops.fused_add_rms_norm(x.clone(), residual.clone(), w, 1e-6)
    res0 = residual.clone()
    normed, summed = cpu.fused_add_rms_norm(x, residual, w, 1e-6)
    assert summed is x and torch.equal(x, want_sum) and torch.equal(residual, res0)
    torch.testing.assert_close(normed, want_norm, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim", [80, 48])  # full and partial rotary
@pytest.mark.parametrize("cache_dtype", ["float32", "same"])
def test_rotary_is_bitwise_reference_on_qkv_views(cpu, dtype, rot_dim, cache_dtype):
    g = torch.Generator().manual_seed(3)
    cos_sin = torch.randn(100, rot_dim, generator=g).to(torch.float32 if cache_dtype == "float32" else dtype)
    pos = torch.randint(0, 100, (9,), generator=g)
    qkv = torch.randn(9, (5 + 2) * 80, generator=g).to(dtype)
    q, k = qkv[:, :5 * 80].view(9, 5, 80), qkv[:, 5 * 80:].view(9, 2, 80)
    q0, k0 = q.clone(), k.clone()
    got, want = cpu.rotary(pos, q, k, cos_sin), ref_ops.rotary(pos, q0, k0, cos_sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(q, q0) and torch.equal(k, k0)  # new tensors, as the hook says


def test_rotary_rejects_a_position_past_the_cache(cpu):
    with pytest.raises(RuntimeError, match="outside the cos/sin cache"):
        cpu.rotary(torch.tensor([4]), torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(4, 8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_of_qkv_views_skips_padding(cpu, dtype):
    g = torch.Generator().manual_seed(4)
    nb, bs, hkv, d = 5, 16, 3, 40
    kv = torch.randn(21, 2 * hkv * d, generator=g).to(dtype)
    key, value = kv[:, :hkv * d].view(21, hkv, d), kv[:, hkv * d:].view(21, hkv, d)
    slots = torch.randperm(nb * bs, generator=g)[:21]
    slots[[0, 7, 20]] = -1
    want = torch.full((2, nb, bs, hkv, d), float("nan"), dtype=dtype)
    got = want.clone()
    ref_ops.write_kv(key, value, want, slots)
    cpu.write_kv(key, value, got, slots, 1.0, 1.0)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got.isnan().sum() == 2 * (nb * bs - 18) * hkv * d  # exactly the 18 real slots were written
