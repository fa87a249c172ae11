"""Mamba2's state ops (``pagedllm.backend.ssm_ops``) against transformers' own pure-torch Mamba2 paths, with each
other (chunked vs whole, recurrent vs chunked), and conformance catching a backend that drops the initial state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mamba2 import modeling_mamba2 as hf

from pagedllm.backend import ssm_ops
from pagedllm.backend.registry import Backend
from pagedllm.conformance import run_conformance
from plugin_factory import make_plugin

HEADS, HEAD_DIM, GROUPS, D_STATE = 4, 8, 2, 16
STATE_KERNELS = ["mamba_chunk_scan_combined.*", "selective_state_update.*"]


def inputs(tokens: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    return dict(x=rnd(tokens, HEADS, HEAD_DIM), dt=rnd(tokens, HEADS, scale=0.5), A=-(torch.rand(HEADS, generator=gen)
                + 0.5), B=rnd(tokens, GROUPS, D_STATE, scale=0.5), C=rnd(tokens, GROUPS, D_STATE, scale=0.5),
                D=rnd(HEADS), z=rnd(tokens, HEADS, HEAD_DIM), dt_bias=rnd(HEADS, scale=0.5))


def hf_step(state, p, t):
    """transformers' decode step for token t, called as its Mamba2 mixer calls it (tied per-head parameters)."""
    x = p["x"][t:t + 1]
    return hf.mamba2_selective_state_update(
        state, x, p["dt"][t:t + 1, :, None].expand(-1, -1, HEAD_DIM),
        p["A"][:, None, None].expand(-1, HEAD_DIM, D_STATE),
        p["B"][t:t + 1], p["C"][t:t + 1], p["D"][:, None].expand(-1, HEAD_DIM), z=p["z"][t:t + 1],
        dt_bias=p["dt_bias"][:, None].expand(-1, HEAD_DIM), dt_softplus=True)


def test_selective_state_update_matches_transformers_in_place_at_the_slots():
    lengths, slots = (5, 3, 7), (6, 1, 3)
    p = [inputs(n, seed=i) for i, n in enumerate(lengths)]
    pool = torch.randn(8, HEADS, HEAD_DIM, D_STATE)
    hf_states = [pool[s].clone()[None] for s in slots]
    untouched = [i for i in range(8) if i not in slots]
    before = pool[untouched].clone()
    for t in range(max(lengths)):
        live = [i for i in range(3) if t < lengths[i]]
        rows = {k: torch.stack([p[i][k][t] for i in live] + [p[0][k][0]])  # the last row is padding (slot -1)
                for k in ("x", "dt", "B", "C", "z")}
        idx = torch.tensor([slots[i] for i in live] + [-1], dtype=torch.int32)
        out = ssm_ops.selective_state_update(pool, rows["x"], rows["dt"], p[0]["A"], rows["B"], rows["C"], p[0]["D"],
                                             rows["z"], p[0]["dt_bias"], True, idx)
        for j, i in enumerate(live):
            q = dict(p[i], A=p[0]["A"], D=p[0]["D"], dt_bias=p[0]["dt_bias"])
            want = hf_step(hf_states[i], q, t)
            torch.testing.assert_close(out[j], want[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # padding row: zero output, no state touched
    for i, s in enumerate(slots):
        torch.testing.assert_close(pool[s], hf_states[i][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[untouched], before)


def test_chunk_scan_matches_transformers_per_sequence_of_a_varlen_batch():
    lengths = (1, 19, 40, 8)
    total = sum(lengths)
    p = inputs(total)
    init = torch.randn(len(lengths), HEADS, HEAD_DIM, D_STATE)
    init[0] = 0  # a fresh sequence beside continuing ones
    cu = torch.tensor([0, 1, 20, 60, 68], dtype=torch.int32)
    limit = (0.2, 1.5)
    out, finals = ssm_ops.mamba_chunk_scan_combined(p["x"], p["dt"], p["A"], p["B"], p["C"], 8, cu, init, p["D"],
                                                    None, p["dt_bias"], True, limit)
    gated, finals_z = ssm_ops.mamba_chunk_scan_combined(p["x"], p["dt"], p["A"], p["B"], p["C"], 16, cu, init,
                                                        p["D"], p["z"], p["dt_bias"], True, limit)
    assert out.shape == (total, HEADS, HEAD_DIM) and finals.dtype == torch.float32
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        want, want_state = hf.mamba2_chunk_scan(
            p["x"][None, a:b], p["dt"][None, a:b], p["A"], p["B"][None, a:b], p["C"][None, a:b], chunk_size=8,
            D=p["D"], dt_bias=p["dt_bias"], initial_states=init[i:i + 1], dt_softplus=True, dt_limit=limit,
            return_final_states=True)
        torch.testing.assert_close(out[a:b], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(finals[i], want_state[0], atol=1e-5, rtol=1e-5)
        # z gates the output after D (Mamba2's gating; transformers gates in its norm instead), any chunk size
        torch.testing.assert_close(gated[a:b], want[0] * F.silu(p["z"][a:b]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(finals_z[i], want_state[0], atol=1e-5, rtol=1e-5)


def test_chunked_calls_with_the_state_carried_equal_one_pass_and_the_recurrent_op():
    p = inputs(53)
    init = torch.randn(1, HEADS, HEAD_DIM, D_STATE)
    args = lambda s: (p["x"][s], p["dt"][s], p["A"], p["B"][s], p["C"][s])  # noqa: E731
    whole, whole_state = ssm_ops.mamba_chunk_scan_combined(*args(slice(None)), 16, None, init, p["D"], p["z"],
                                                           p["dt_bias"], True)
    state, pieces = init, []
    for s in (slice(0, 1), slice(1, 21), slice(21, 22), slice(22, 53)):  # one token, several chunks, ragged ends
        o, state = ssm_ops.mamba_chunk_scan_combined(*args(s), 16, None, state, p["D"], p["z"][s], p["dt_bias"],
                                                     True)
        pieces.append(o)
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, whole_state, atol=1e-5, rtol=1e-5)
    pool, steps = torch.zeros(3, HEADS, HEAD_DIM, D_STATE), []
    pool[2] = init[0]
    for t in range(53):
        steps.append(ssm_ops.selective_state_update(pool, p["x"][t:t + 1], p["dt"][t:t + 1], p["A"],
                                                    p["B"][t:t + 1], p["C"][t:t + 1], p["D"], p["z"][t:t + 1],
                                                    p["dt_bias"], True, torch.tensor([2])))
    torch.testing.assert_close(torch.cat(steps), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[2], whole_state[0], atol=1e-5, rtol=1e-5)


def test_low_precision_activations_and_state_cache():
    """bfloat16 activations with a bfloat16 state cache: float32 arithmetic, output in x's dtype, state stored in
    the cache's dtype."""
    p = inputs(4)
    pool = torch.randn(4, HEADS, HEAD_DIM, D_STATE)
    low = pool.to(torch.bfloat16)
    idx = torch.tensor([3, 0, 1, 2])
    want = ssm_ops.selective_state_update(pool, p["x"], p["dt"], p["A"], p["B"], p["C"], p["D"], p["z"],
                                          p["dt_bias"], True, idx)
    got = ssm_ops.selective_state_update(low, *(p[k].to(torch.bfloat16) if k not in ("A",) else p[k] for k in
                                                ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")), True, idx)
    assert got.dtype == low.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)
    torch.testing.assert_close(low.float(), pool, atol=0.05, rtol=0.02)


def scan_ignoring_initial_states(x, dt, A, B, C, chunk_size, cu_seqlens, initial_states, D, z, dt_bias, dt_softplus,
                                 dt_limit):
    """Every sequence starts fresh: the state carried between prefill chunks is dropped."""
    return ssm_ops.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, cu_seqlens, None, D, z, dt_bias,
                                             dt_softplus, dt_limit)


def update_at_row_not_slot(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_indices):
    """Reads and writes state row i for batch row i, whatever its slot."""
    return ssm_ops.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                          torch.arange(x.shape[0]))


def test_conformance_catches_a_dropped_initial_state_and_a_slot_bug():
    bad = Backend(make_plugin("ssm-buggy", mamba_chunk_scan_combined=scan_ignoring_initial_states,
                              selective_state_update=update_at_row_not_slot), "ssm-buggy")
    report = run_conformance(bad, allow=STATE_KERNELS)
    status = {r.id: r.status for r in report.results if r.status != "untested"}
    m = "h4-p8-g2-n16-chunk8|float32"
    assert status == {f"mamba_chunk_scan_combined.varlen[{m}]": "failing",
                      f"mamba_chunk_scan_combined.state_carried[{m}]": "failing",
                      f"mamba_chunk_scan_combined.dt_limit[{m}]": "failing",
                      f"mamba_chunk_scan_combined.fresh[{m}]": "passing",  # nothing to carry: it cannot show
                      f"mamba_chunk_scan_combined.strong_decay[{m.replace('chunk8', 'chunk32')}]": "failing",
                      f"selective_state_update.decode[{m}]": "failing",
                      f"selective_state_update.vs_chunk_scan[{m}]": "failing"}, status
    carried = next(r for r in report.results if r.kernel == "mamba_chunk_scan_combined.state_carried")
    assert "over 3 calls, state carried" in carried.error and "continuing" in carried.error, carried.error
    assert not report.passed


@pytest.mark.parametrize("device", ["cpu", "cpu-static"])
def test_state_op_conformance_passes_on_the_cpu_backends(device):
    report = run_conformance(device, allow=STATE_KERNELS)
    ran = [r for r in report.results if r.status != "untested"]
    assert len(ran) == 7 * 3 and all(r.status == "passing" for r in ran), [(r.id, r.error) for r in ran]
    assert {r.dtype for r in ran} == {"float32", "bfloat16", "float16"}
    assert not any(r.fallback for r in ran)  # the CPU backend's own ops (pagedllm_cpu.state_ops), not the reference
