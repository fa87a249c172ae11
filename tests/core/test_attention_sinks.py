"""Attention sinks in the paged attention contract (issue 28): the reference op against transformers' GPT-OSS eager
attention (a dense oracle), the CPU backend against the reference (decode through its C++ kernel and through the
torch path, prefill with context, sliding window, GQA, NaN-poisoned caches), the conformance cases, and the start-up
refusal on a backend that does not declare them."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from pagedllm.backend import ref_ops
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import Capabilities, ModelInfo
from pagedllm.backend.registry import Backend, get_backend
from pagedllm.config import EngineConfig, resolve_config
from pagedllm.conformance import run_conformance
from pagedllm.errors import ParamError
from pagedllm_cpu import attention as cpu_attention
from pagedllm_cpu import native
from plugin_factory import REFERENCE_FEATURES, make_plugin

HEADS, KV_HEADS, HEAD = 10, 2, 48  # GQA 5:1, head size not a power of two


def _paged(seq_lens: list[int], bs: int, dtype=torch.float32, seed: int = 0):
    """Per sequence: dense keys/values ``[S, Hkv, D]``, written into a NaN-poisoned canonical cache through
    scattered block tables. Returns (keys, values, cache, tables)."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [(s + bs - 1) // bs for s in seq_lens]
    ids = list(range(1, sum(nblocks) + 1))
    random.Random(seed).shuffle(ids)
    cache = torch.full((2, sum(nblocks) + 1, bs, KV_HEADS, HEAD), float("nan"), dtype=dtype)
    keys, values, tables, start = [], [], [], 0
    for s, n in zip(seq_lens, nblocks):
        table = ids[start:start + n]
        start += n
        k, v = torch.randn(s, KV_HEADS, HEAD, generator=g), torch.randn(s, KV_HEADS, HEAD, generator=g)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(s)])
        ref_ops.write_kv(k.to(dtype), v.to(dtype), cache, slots)
        keys.append(k)
        values.append(v)
        tables.append(table)
    return keys, values, cache, tables


def _sinks(seed: int = 1) -> torch.Tensor:
    """Sink logits from negligible to dominant: the effect shows in every head."""
    return torch.randn(HEADS, generator=torch.Generator().manual_seed(seed)) * 3.0


def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
            window) -> torch.Tensor:
    """transformers' GPT-OSS ``eager_attention_forward`` over one whole sequence, queries its last ``L`` tokens."""
    L, S = q.shape[0], k.shape[0]
    q_pos = torch.arange(S - L, S)[:, None]
    k_pos = torch.arange(S)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    mask = torch.zeros(L, S).masked_fill(~allowed, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, sinks=sinks, training=False)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scale)
    return out[0]  # [L, H, D]


# (query lens, seq lens): decodes first, then prefill chunks (one from scratch, one after cached context)
DECODE = ([1, 1, 1, 1], [1, 4, 5, 37])
MIXED = ([1, 1, 13, 6, 9], [3, 21, 13, 19, 30])


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
def test_reference_sinks_match_transformers_eager(lens, window):
    qlens, slens = lens
    bs = 4
    keys, values, cache, tables = _paged(slens, bs)
    meta = AttentionMetadata.build(qlens, slens, tables, bs)
    query = torch.randn(sum(qlens), HEADS, HEAD, generator=torch.Generator().manual_seed(2))
    sinks, scale = _sinks(), HEAD ** -0.5
    got = ref_ops.paged_attention(query, cache, meta, scale, window, None, sinks=sinks)
    plain = ref_ops.paged_attention(query, cache, meta, scale, window, None)
    for i, (k, v) in enumerate(zip(keys, values)):
        lo, hi = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        want = _oracle(query[lo:hi], k, v, sinks, scale, window)
        torch.testing.assert_close(got[lo:hi], want, rtol=1e-5, atol=1e-5)
    # the sinks take probability mass: outputs shrink towards zero (a sink is a key whose value is zero)
    assert not torch.allclose(got, plain, atol=1e-3)
    assert (got.norm(dim=-1) <= plain.norm(dim=-1) + 1e-5).all()


@pytest.fixture(scope="module")
def kernel():
    """The CPU plugin's C++ decode kernel, built (or loaded) now: a failed build fails the kernel cases."""
    op = native.get(wait=True, timeout=600)
    assert op is not None, f"the CPU C++ ops did not build: {native.error()}"
    return op


@pytest.mark.parametrize("path", ["fused", "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 64])
@pytest.mark.parametrize("lens", [DECODE, MIXED, ([7, 1], [7, 9])], ids=["decode", "mixed", "prefill"])
@pytest.mark.parametrize("bs", [4, 16])
def test_cpu_sinks_match_reference(kernel, monkeypatch, lens, window, dtype, bs, path):
    """Both CPU paths: ``fused`` (decodes in the C++ kernel, prefill chunks on torch's flash kernel rescaled by
    their log-sum-exp) and ``float32`` (C++ ops disabled, no flash kernel: the float32 matmul path); prefill from
    scratch and after cached context, windows shorter and longer than the sequences; unwritten slots hold NaN."""
    if path == "float32":
        monkeypatch.setenv("PAGEDLLM_CPU_PAGED_DECODE", "0")
        monkeypatch.setattr(cpu_attention, "_FLASH_LSE", None)
    assert (native.get() is not None) == (path == "fused")
    assert (cpu_attention._FLASH_LSE is not None) == (path == "fused")
    qlens, slens = lens
    _, _, cache, tables = _paged(slens, bs, dtype)
    meta = AttentionMetadata.build(qlens, slens, tables, bs)
    query = torch.randn(sum(qlens), HEADS, HEAD, generator=torch.Generator().manual_seed(3)).to(dtype)
    sinks, scale = _sinks(), HEAD ** -0.5
    cpu = get_backend("cpu")
    assert cpu.capabilities.attention_sinks
    got = cpu.paged_attention(query, cache, meta, scale, window, None, 1.0, 1.0, sinks=sinks)
    want = ref_ops.paged_attention(query, cache, meta, scale, window, None, sinks=sinks)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("window,cap", [(None, None), (6, None), (None, 2.0)])
def test_kernel_sinks_match_reference(kernel, dtype, window, cap):
    """The kernel itself: sinks from negligible to far above every score (the rescaled denominator), GQA 5:1."""
    qlens, slens = [1] * 6, [1, 4, 5, 16, 17, 61]
    _, _, cache, tables = _paged(slens, 8, dtype)
    meta = AttentionMetadata.build(qlens, slens, tables, 8)
    query = torch.randn(6, HEADS, HEAD, generator=torch.Generator().manual_seed(5)).to(dtype)
    sinks = _sinks()
    sinks[0], sinks[1] = 200.0, -200.0  # exp(sink) dwarfs / vanishes beside the scores: no overflow, no NaN
    out = torch.full_like(query, float("nan"))
    kernel(out, query, cache, meta.block_tables, meta.seq_lens, 0.3, window or 0, cap or 0.0, None, sinks)
    want = ref_ops.paged_attention(query, cache, meta, 0.3, window, cap, sinks=sinks)
    assert not out.isnan().any()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), want.float(), **tol)
    assert out[:, 0].abs().max() < 1e-6  # a dominant sink takes all the mass


def test_cpu_sinks_with_soft_cap_match_reference():
    """Both float32-path features at once: the sink is a raw logit, added after the cap."""
    qlens, slens = MIXED
    _, _, cache, tables = _paged(slens, 4)
    meta = AttentionMetadata.build(qlens, slens, tables, 4)
    query = torch.randn(sum(qlens), HEADS, HEAD, generator=torch.Generator().manual_seed(4)) * 3
    got = get_backend("cpu").paged_attention(query, cache, meta, 0.2, None, 1.5, 1.0, 1.0, sinks=_sinks())
    torch.testing.assert_close(got, ref_ops.paged_attention(query, cache, meta, 0.2, None, 1.5, sinks=_sinks()),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["cpu", "cpu-static"])
def test_conformance_sinks_cases_pass(name):
    report = run_conformance(name, allow=["paged_attention.sinks.*"], gqa_ratios=(3,))
    cases = [r for r in report.results if r.kernel.startswith("paged_attention.sinks")]
    kernels = {r.kernel for r in cases}
    assert kernels == {"paged_attention.sinks.decode", "paged_attention.sinks.prefill", "paged_attention.sinks.mixed",
                       "paged_attention.sinks.mixed.sliding_window"}
    assert cases and all(r.status == "passing" and not r.fallback for r in cases), \
        [(r.id, r.status, r.error) for r in cases if r.status != "passing"]


def _wrong_sinks_attention(query, kv_cache, meta, scale, sliding_window, soft_cap, k_scale, v_scale,
                           alibi_slopes=None, sinks=None):
    """Scales the sink by the softmax scale (a plausible bug: treating it as a dot product)."""
    return ref_ops.paged_attention(query, kv_cache, meta, scale, sliding_window, soft_cap, k_scale, v_scale,
                                   alibi_slopes, None if sinks is None else sinks * scale)


def test_conformance_catches_wrong_sinks():
    caps = Capabilities(**REFERENCE_FEATURES, attention_sinks=True)
    bad = Backend(make_plugin("badsinks", caps, paged_attention=_wrong_sinks_attention), "badsinks")
    report = run_conformance(bad, allow=["paged_attention.sinks.*", "paged_attention.mixed"], gqa_ratios=(3,))
    sinks = [r for r in report.results if r.kernel.startswith("paged_attention.sinks")]
    assert sinks and all(r.status == "failing" for r in sinks)
    assert all(r.status == "passing" for r in report.results if r.kernel == "paged_attention.mixed")


def test_sinks_cases_are_not_applicable_without_the_capability():
    own = Backend(make_plugin("nosinks-conf", paged_attention=ref_ops.paged_attention), "nosinks-conf")
    assert not own.capabilities.attention_sinks
    report = run_conformance(own, allow=["paged_attention.sinks.*"], gqa_ratios=(3,))
    sinks = [r for r in report.results if r.kernel.startswith("paged_attention.sinks")]
    assert sinks and all(r.not_applicable and r.error == "capabilities do not declare attention_sinks"
                         for r in sinks)


INFO = ModelInfo("GptOssForCausalLM", "float32", 2, HEADS, KV_HEADS, HEAD, 500, 512, sliding_window=8,
                 attention_sinks=True)


def test_backend_without_sinks_is_refused_at_start_up():
    caps = Capabilities(head_sizes=None, sliding_window=True)
    own = Backend(make_plugin("nosinks", caps, paged_attention=ref_ops.paged_attention), "nosinks")
    with pytest.raises(ParamError, match=r"model: GptOssForCausalLM uses attention sinks .*backend 'nosinks' does "
                                         r"not support \(Capabilities\.attention_sinks\)"):
        resolve_config(EngineConfig(), own, INFO)
    # core's reference attention does sinks: a backend that leaves attention to it is not refused
    assert Backend(make_plugin("refsinks", caps), "refsinks").capabilities.attention_sinks
    resolve_config(EngineConfig(), Backend(make_plugin("refsinks", caps), "refsinks"), INFO)
    resolve_config(EngineConfig(), own, replace(INFO, attention_sinks=False))
