"""Issue 32's per-op cuts on the CPU decode path: the ops called through their resolved overload (``ops.direct``) and a
pure-decode step attended in one kernel call, without the step plan or the decode slices, equal to the reference."""

from __future__ import annotations

import pytest
import torch

import pagedllm.backend.registry as backends
from pagedllm.backend import ref_ops
from pagedllm_cpu import attention as cpu_attention
from pagedllm_cpu import ops
from test_cpu_backend import make_batch


@pytest.fixture(scope="module")
def cpu() -> backends.Backend:
    return backends.get_backend("cpu")


def test_direct_ops_are_the_library_ops_resolved_once(lib):
    """``ops.direct.x`` computes what the packet ``lib.x`` computes, and is resolved on first use only."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 576, generator=g), torch.randn(576, generator=g)
    assert torch.equal(ops.direct.rms_norm(x, w, 1e-6), lib.rms_norm(x, w, 1e-6))
    assert "rms_norm" in vars(ops.direct)  # cached as an attribute: no lookup on the next call
    gu = torch.randn(2, 64, generator=g)
    assert torch.equal(ops.direct.silu_and_mul(gu), lib.silu_and_mul(gu))
    torch.testing.assert_close(ops.silu_and_mul(gu), ref_ops.silu_and_mul(gu))
    with pytest.raises(AttributeError):
        ops.direct.no_such_op  # noqa: B018 - a name the library lacks fails as an attribute, not silently


@pytest.mark.parametrize("seq_lens", [[1], [64], [5, 33, 151]], ids=["first-token", "ctx64", "batch3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pure_decode_step_is_one_kernel_call(lib, cpu, seq_lens, dtype):
    """A step of decodes only: the hook's output is the kernel's, equal to the reference, and no plan is built."""
    query, cache, meta = make_batch([1] * len(seq_lens), seq_lens, 9, 3, 64, 16, dtype, seed=3)
    want = ref_ops.paged_attention(query, cache, meta, 0.125, None, None)
    got = cpu.paged_attention(query, cache, meta, 0.125, None, None, 1.0, 1.0)
    assert cpu_attention._PLAN_KEY not in meta.extra
    assert not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    direct = torch.empty_like(query)
    lib.paged_decode_attention(direct, query, cache, meta.block_tables, meta.seq_lens, 0.125, 0, 0.0, None)
    assert torch.equal(got, direct)


def test_mixed_step_still_plans_its_prefills(lib, cpu):
    """A decode beside a prefill chunk keeps the planned path (decodes on the kernel, the chunk on SDPA)."""
    query, cache, meta = make_batch([1, 7], [20, 7], 9, 3, 64, 16, torch.float32, seed=4)
    want = ref_ops.paged_attention(query, cache, meta, 0.125, None, None)
    got = cpu.paged_attention(query, cache, meta, 0.125, None, None, 1.0, 1.0)
    assert list(meta.extra[cpu_attention._PLAN_KEY]) == [(None, False)]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
