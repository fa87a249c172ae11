"""The gated delta rule (``pagedllm.backend.delta_rule_ops``) against transformers' own pure-torch Qwen3-Next paths,
with itself (chunked vs whole, recurrent vs chunked), and conformance catching a backend that drops the state."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from pagedllm.backend import delta_rule_ops as ops
from pagedllm.backend.registry import Backend
from pagedllm.conformance import run_conformance
from plugin_factory import make_plugin

H, HV, K, V = 2, 4, 16, 8  # two value heads per query/key head (Qwen3-Next's grouped value heads)
STATE_KERNELS = ["chunk_gated_delta_rule.*", "fused_recurrent_gated_delta_rule.*"]


def inputs(tokens: int, seed: int = 0, unit_keys: bool = False) -> dict:
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(tokens, H, K, generator=gen), torch.randn(tokens, H, K, generator=gen)
    if unit_keys:  # what a model without the in-kernel norm feeds (unnormalised keys diverge)
        k = ops.l2norm(k)
    g = -torch.nn.functional.softplus(torch.randn(tokens, HV, generator=gen)) * 0.5  # Qwen3-Next's log decay, < 0
    beta = torch.sigmoid(torch.randn(tokens, HV, generator=gen))
    return dict(q=q, k=k, v=torch.randn(tokens, HV, V, generator=gen), g=g, beta=beta)


def qkvgb(p: dict, s=slice(None)) -> list:
    return [p[n][s] for n in ("q", "k", "v", "g", "beta")]


@pytest.mark.parametrize("l2norm", [True, False])
def test_chunked_op_matches_transformers_per_sequence_of_a_varlen_batch(l2norm):
    lengths = (1, 30, 64, 77)  # one token, under a chunk, exactly one, over one
    cu = torch.tensor([0, 1, 31, 95, 172], dtype=torch.int32)
    p = inputs(sum(lengths), unit_keys=not l2norm)
    init = torch.randn(4, HV, K, V)
    init[2] = 0  # a fresh sequence beside continuing ones
    out, finals = ops.chunk_gated_delta_rule(*qkvgb(p), init, cu, None, l2norm)
    assert out.shape == (172, HV, V) and finals.shape == (4, HV, K, V) and finals.dtype == torch.float32
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        want, want_state = hf.torch_chunk_gated_delta_rule(
            *(t[None] for t in qkvgb(p, slice(a, b))), initial_state=init[i:i + 1], output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm)
        torch.testing.assert_close(out[a:b], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(finals[i], want_state[0], atol=1e-5, rtol=1e-5)


def test_recurrent_op_matches_transformers_in_place_at_the_slots():
    p = inputs(12)
    pool = torch.randn(6, HV, K, V)
    slot, untouched = 4, [0, 1, 2, 3, 5]
    before = pool[untouched].clone()
    hf_state = pool[slot].clone()[None]
    for t in range(12):
        # batch: the sequence's token, then a padding row (slot -1)
        rows = [torch.cat([x[t:t + 1], x[:1]]) for x in qkvgb(p)]
        out = ops.fused_recurrent_gated_delta_rule(*rows, pool, torch.tensor([slot, -1]), None, True)
        want, hf_state = hf.torch_recurrent_gated_delta_rule(*(x[None, t:t + 1] for x in qkvgb(p)),
                                                             initial_state=hf_state, output_final_state=True,
                                                             use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[0], want[0, 0], atol=1e-5, rtol=1e-5)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(pool[slot], hf_state[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[untouched], before)


def test_chunked_calls_with_the_state_carried_equal_one_pass_and_the_recurrent_op():
    p = inputs(150)
    init = torch.randn(1, HV, K, V)
    whole, whole_state = ops.chunk_gated_delta_rule(*qkvgb(p), init, None, 0.2, True)
    state, pieces = init, []
    for s in (slice(0, 1), slice(1, 70), slice(70, 71), slice(71, 150)):
        o, state = ops.chunk_gated_delta_rule(*qkvgb(p, s), state, None, 0.2, True, chunk_size=16)
        pieces.append(o)
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, whole_state, atol=1e-5, rtol=1e-5)
    pool, steps = torch.zeros(2, HV, K, V), []
    pool[1] = init[0]
    for t in range(150):
        steps.append(ops.fused_recurrent_gated_delta_rule(*qkvgb(p, slice(t, t + 1)), pool, torch.tensor([1]), 0.2,
                                                          True))
    torch.testing.assert_close(torch.cat(steps), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[1], whole_state[0], atol=1e-5, rtol=1e-5)


def test_low_precision_activations_and_state_cache():
    p = inputs(3)
    pool = torch.randn(3, HV, K, V)
    low = pool.to(torch.bfloat16)
    idx = torch.tensor([2, 0, 1])
    want = ops.fused_recurrent_gated_delta_rule(*qkvgb(p), pool, idx, None, True)
    got = ops.fused_recurrent_gated_delta_rule(*(x.to(torch.bfloat16) for x in qkvgb(p)), low, idx, None, True)
    assert got.dtype == low.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)
    torch.testing.assert_close(low.float(), pool, atol=0.05, rtol=0.02)


def chunk_ignoring_initial_state(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel):
    """Every sequence starts fresh: the state carried between prefill chunks is dropped."""
    return ops.chunk_gated_delta_rule(q, k, v, g, beta, None, cu_seqlens, scale, use_qk_l2norm_in_kernel)


def recurrent_without_l2norm(q, k, v, g, beta, scale, state, state_indices, use_qk_l2norm_in_kernel):
    """Forgets the in-kernel q/k normalisation."""
    return ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, state_indices, scale, False)


def test_conformance_catches_a_dropped_initial_state_and_a_missing_norm():
    bad = Backend(make_plugin("gdn-buggy", chunk_gated_delta_rule=chunk_ignoring_initial_state,
                              fused_recurrent_gated_delta_rule=recurrent_without_l2norm), "gdn-buggy")
    report = run_conformance(bad, allow=STATE_KERNELS)
    status = {r.id: r.status for r in report.results if r.status != "untested"}
    d = "h2-hv4-k16-v8"
    assert status == {f"chunk_gated_delta_rule.varlen[{d}-l2norm|float32]": "failing",
                      f"chunk_gated_delta_rule.state_carried[{d}-l2norm|float32]": "failing",
                      f"chunk_gated_delta_rule.varlen[{d}|float32]": "failing",
                      f"chunk_gated_delta_rule.state_carried[{d}|float32]": "failing",
                      f"chunk_gated_delta_rule.fresh[{d}-l2norm-scale0.3|float32]": "passing",  # nothing to carry
                      f"chunk_gated_delta_rule.strong_decay[{d}-l2norm|float32]": "failing",
                      f"fused_recurrent_gated_delta_rule.decode[{d}-l2norm|float32]": "failing",
                      f"fused_recurrent_gated_delta_rule.vs_chunked[{d}-l2norm|float32]": "failing",
                      f"fused_recurrent_gated_delta_rule.decode[{d}|float32]": "passing",  # no norm asked
                      f"fused_recurrent_gated_delta_rule.vs_chunked[{d}|float32]": "passing"}, status
    carried = next(r for r in report.results if r.kernel == "chunk_gated_delta_rule.state_carried")
    assert "over 3 calls, state carried" in carried.error and "continuing" in carried.error, carried.error


@pytest.mark.parametrize("device", ["cpu", "cpu-static"])
def test_state_op_conformance_passes_on_the_cpu_backends(device):
    report = run_conformance(device, allow=STATE_KERNELS)
    ran = [r for r in report.results if r.status != "untested"]
    assert len(ran) == 10 * 3 and all(r.status == "passing" for r in ran), [(r.id, r.error) for r in ran]
    assert not any(r.fallback for r in ran)  # the CPU backend's own ops (pagedllm_cpu.state_ops), not the reference
