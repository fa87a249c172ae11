"""The ``pagedllm_encoder_attention`` hook: core's reference against torch's SDPA run per sequence (an independent
oracle), the CPU backend against the reference, the causal flag honoured, sequences never mixed, and a plugin that
predates the hook still loading (the reference serves it) and passing its conformance cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.backend import ref_ops
from pagedllm.backend.hookspec import API_VERSION, BackendInfo, MemoryInfo, ProbeResult, hookimpl
from pagedllm.backend.registry import Backend, get_backend
from pagedllm.conformance.runner import run_conformance

LENS = [1, 9, 33, 4, 70]


def inputs(lens, heads, kv_heads, head_size, dtype=torch.float32, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens) + pad
    q, k, v = (torch.randn(t, h, head_size, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def sdpa_per_sequence(q, k, v, cu, scale, causal):
    """torch's SDPA on one ``[1, H, L, D]`` sequence at a time, GQA expanded by hand."""
    group = q.shape[1] // k.shape[1]
    out = []
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        qs, ks, vs = (x[s:e].float().transpose(0, 1)[None] for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)[0].transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_reference_equals_torch_sdpa(causal, heads, kv_heads):
    q, k, v, cu = inputs(LENS, heads, kv_heads, 32)
    ref = ref_ops.encoder_attention(q, k, v, cu, max(LENS), 32 ** -0.5, causal)
    torch.testing.assert_close(ref, sdpa_per_sequence(q, k, v, cu, 32 ** -0.5, causal), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_cpu_backend_equals_reference(dtype, tol, causal, heads, kv_heads):
    q, k, v, cu = inputs(LENS, heads, kv_heads, 64, dtype, pad=5)  # 5 padding rows after the last sequence
    cpu = get_backend("cpu")
    assert cpu.implements("pagedllm_encoder_attention")
    out = cpu.encoder_attention(q, k, v, cu, max(LENS), 0.125, causal)
    ref = ref_ops.encoder_attention(q, k, v, cu, max(LENS), 0.125, causal)
    assert out.shape == ref.shape and out.dtype == dtype
    n = sum(LENS)
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=tol, rtol=tol)


def test_causal_flag_is_honoured_and_sequences_are_isolated():
    """Bidirectional: changing the last token of a sequence changes its first row; causal: it does not. Either way
    no other sequence changes."""
    cpu = get_backend("cpu")
    q, k, v, cu = inputs([6, 5, 7], 4, 2, 16)
    last = 10  # the second sequence's last row
    k2, v2 = k.clone(), v.clone()
    k2[last] += 3.0
    v2[last] -= 2.0
    for fn in (cpu.encoder_attention, ref_ops.encoder_attention):
        for causal in (False, True):
            a = fn(q, k, v, cu, 7, 0.25, causal)
            b = fn(q, k2, v2, cu, 7, 0.25, causal)
            changed = (a - b).abs().amax(dim=(1, 2)) > 1e-6
            assert changed[last]
            assert bool(changed[6]) is (not causal)  # the second sequence's first row sees its last only both ways
            assert not changed[:6].any() and not changed[11:].any()  # other sequences untouched


class PluginWithoutTheHook:
    """An older plugin (the oldest contract core loads), written before the hook existed (no
    ``pagedllm_encoder_attention``): it must still load."""

    @hookimpl
    def pagedllm_backend_info(self):
        return BackendInfo(name="old-plugin", device_type="cpu", api_version=API_VERSION - 1)

    @hookimpl
    def pagedllm_probe(self):
        return ProbeResult(usable=True)

    @hookimpl
    def pagedllm_memory_info(self, device):
        return MemoryInfo(total_bytes=1 << 30, free_bytes=1 << 30)


def test_plugin_without_the_hook_loads_and_runs_the_reference():
    be = Backend(PluginWithoutTheHook(), "old-plugin")
    assert not be.implements("pagedllm_encoder_attention")
    q, k, v, cu = inputs(LENS, 4, 2, 16)
    torch.testing.assert_close(be.encoder_attention(q, k, v, cu, max(LENS), 0.25, False),
                               ref_ops.encoder_attention(q, k, v, cu, max(LENS), 0.25, False))
    report = run_conformance(be, allow=["encoder_attention*"])
    rows = [r for r in report.results if r.kernel.startswith("encoder_attention")]
    assert rows and all(r.status == "passing" and r.fallback for r in rows), [(r.id, r.status) for r in rows]


def test_cpu_conformance_cases_cover_both_directions_gqa_and_padding():
    report = run_conformance("cpu", allow=["encoder_attention*|float32]"], gqa_ratios=(1, 3))
    rows = [r for r in report.results if r.kernel.startswith("encoder_attention") and r.status != "untested"]
    assert {r.kernel for r in rows} == {"encoder_attention.bidirectional", "encoder_attention.causal"}
    assert {r.model.split("-")[0] for r in rows} == {"single", "varlen", "many_short", "padded", "images"}
    assert {r.model.rsplit("-", 1)[1] for r in rows} == {"gqa1", "gqa3"}
    assert all(r.status == "passing" and not r.fallback for r in rows), [(r.id, r.status, r.error) for r in rows]
