"""Recurrent-state slots (issue 28, contract v3): the slot pool, the KV manager and scheduler that hand slots out
with blocks (never more running stateful requests than slots; freed on finish, abort and preemption, which
recomputes), and the reference causal-conv1d ops against transformers' own LFM2 conv functions."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.backend import conv_ops
from pagedllm.backend.hookspec import API_VERSION, BackendInfo, MambaSpec, MemoryInfo, ProbeResult, hookimpl
from pagedllm.backend.registry import Backend, BackendError
from pagedllm.sched.kv_manager import KVCacheManager
from pagedllm.sched.request import Request, RequestStatus
from pagedllm.sched.scheduler import Scheduler
from pagedllm.sched.state_slots import StateSlotPool


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=4), max_tokens=4)


def test_slot_pool_takes_lowest_free_and_reuses_freed():
    pool = StateSlotPool(3)
    assert [pool.take(r) for r in "abc"] == [0, 1, 2] and pool.num_free == 0
    assert pool.take("b") == 1  # idempotent for a holder
    with pytest.raises(RuntimeError, match="no free state slot for request 'd'"):
        pool.take("d")
    pool.free("b")
    pool.free("b")  # no-op
    assert pool.num_free == 1 and pool.take("d") == 1 and pool.slot_of("d") == 1
    with pytest.raises(ValueError, match="num_slots"):
        StateSlotPool(0)


def test_kv_manager_takes_a_slot_with_the_first_blocks_and_turns_prefix_caching_off(caplog):
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    with caplog.at_level("INFO", logger="pagedllm.sched.kv_manager"):
        kv.use_state_slots(2)
    assert not kv.enable_caching and not kv.pool.enable_caching
    assert "prefix caching off" in caplog.text and "recurrent state" in caplog.text
    a, b, c = _req("a", 6), _req("b", 2), _req("c", 2)
    assert kv.allocate_slots(a, 3) and kv.state_slots.slot_of("a") == 0
    a.num_computed_tokens = 3
    assert kv.allocate_slots(a, 3) and kv.state_slots.slot_of("a") == 0  # the next chunk keeps the slot
    assert kv.allocate_slots(b, 2)
    assert not kv.allocate_slots(c, 2)  # blocks are free, slots are not: refused, nothing taken
    assert kv.num_blocks_of("c") == 0 and not kv.state_slots.has_slot("c")
    kv.free(a)
    assert kv.allocate_slots(c, 2) and kv.state_slots.slot_of("c") == 0
    # short of blocks: no slot is taken either
    kv.free(b)
    kv.free(c)
    big = _req("big", 40)
    assert not kv.allocate_slots(big, 40) and kv.state_slots.num_free == 2
    assert kv.get_computed_blocks(_req("x", 9)) == ([], 0)  # no prefix hits with caching off


def test_scheduler_never_runs_more_stateful_requests_than_slots_and_frees_them():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False)
    kv.use_state_slots(2)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    reqs = [_req(f"r{i}", 5) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"] and len(sched.running) == 2
    sched.update(out)
    assert [s.request.request_id for s in sched.schedule().scheduled] == ["r0", "r1"]  # r2 still waits
    sched.finish(reqs[0], RequestStatus.FINISHED_ABORTED)
    assert kv.state_slots.num_free == 1
    out = sched.schedule()
    assert "r2" in [s.request.request_id for s in out.scheduled] and kv.state_slots.slot_of("r2") == 0


def test_preemption_of_a_stateful_request_recomputes_and_gives_the_slot_back():
    """Two requests, a pool that holds only one of them: the later one is preempted by recompute (no swap pool for
    stateful models), its slot and blocks return, and it starts from token 0 when it resumes."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    kv.use_state_slots(4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a, b = _req("a", 8), _req("b", 7)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update(out)
    assert a.num_computed_tokens == 8 and b.num_computed_tokens == 7
    a.append_token(5)
    b.append_token(5)
    out = sched.schedule()  # a needs a third block: b is preempted
    assert [r.request_id for r in out.preempted] == ["b"] and not out.swap_out
    assert b.num_computed_tokens == 0 and not kv.state_slots.has_slot("b") and kv.state_slots.num_free == 3


# ---- reference ops -----------------------------------------------------------------------------------------------
def _hf_conv(x: torch.Tensor, weight: torch.Tensor, bias, activation=None) -> torch.Tensor:
    """transformers' LFM2 ``causal_conv1d_fn`` over one whole sequence ``[n, dim]`` -> ``[n, dim]``."""
    from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_fn

    return causal_conv1d_fn(x.t()[None], weight, bias, activation=activation)[0].t()


@pytest.mark.parametrize("activation", [None, "silu"])
def test_reference_conv_chunks_and_updates_equal_one_whole_pass(activation):
    """Three sequences cut into chunks (one shorter than the kernel) then decoded token by token, each continuing
    its slot, equal transformers' conv over the whole sequence; slots of other sequences are untouched."""
    g = torch.Generator().manual_seed(0)
    dim, width = 24, 4
    weight, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    seqs = [torch.randn(n, dim, generator=g) for n in (14, 5, 9)]
    # prefill chunks per step (one shorter than the kernel's history, one of a single token); the rest of each
    # sequence then decodes one token at a time
    chunks = [[(0, 5), (5, 6), (6, 9), (9, 12)], [(0, 1), (1, 2)], [(0, 7)]]
    spec = MambaSpec(num_layers=1, num_slots=6, shapes=((dim, width - 1),), dtypes=(torch.float32,),
                     device=torch.device("cpu"))
    (states,), = conv_ops.allocate_state_cache(spec)
    states.normal_(generator=g)  # garbage in the slots: a fresh sequence must never read it
    slots = [4, 1, 3]
    out = [torch.zeros_like(s) for s in seqs]
    for c in range(max(len(k) for k in chunks)):  # one prefill step: chunk c of every sequence that has one
        rows = [(i, *k[c]) for i, k in enumerate(chunks) if c < len(k)]
        qsl = [0]
        for _, lo, hi in rows:
            qsl.append(qsl[-1] + hi - lo)
        x = torch.cat([seqs[i][lo:hi] for i, lo, hi in rows])
        y = conv_ops.causal_conv1d_fn(x, weight, bias, states, torch.tensor(qsl, dtype=torch.int32),
                                      torch.tensor([slots[i] for i, _, _ in rows], dtype=torch.int32),
                                      torch.tensor([lo > 0 for _, lo, _ in rows]), activation)
        for (i, lo, hi), a in zip(rows, qsl):
            out[i][lo:hi] = y[a:a + hi - lo]
    done = [k[-1][1] for k in chunks]
    untouched = states[[0, 2, 5]].clone()
    while any(d < len(s) for d, s in zip(done, seqs)):
        live = [i for i, (d, s) in enumerate(zip(done, seqs)) if d < len(s)]
        x = torch.stack([seqs[i][done[i]] for i in live] + [torch.zeros(dim)])  # plus one padding row
        y = conv_ops.causal_conv1d_update(x, states, weight, bias, activation,
                                          torch.tensor([slots[i] for i in live] + [-1], dtype=torch.int32))
        for j, i in enumerate(live):
            out[i][done[i]] = y[j]
            done[i] += 1
    for s, o in zip(seqs, out):
        torch.testing.assert_close(o, _hf_conv(s, weight, bias, activation), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[[0, 2, 5]], untouched, rtol=0, atol=0)
    torch.testing.assert_close(states[4], seqs[0][-(width - 1):].t())  # the final state: the last inputs


class _Plugin:
    """A plugin of a given contract version implementing only the required hooks."""

    def __init__(self, version: int):
        self.version = version

    @hookimpl
    def pagedllm_backend_info(self):
        return BackendInfo(name=f"v{self.version}-plugin", device_type="cpu", api_version=self.version)

    @hookimpl
    def pagedllm_probe(self):
        return ProbeResult(usable=True)

    @hookimpl
    def pagedllm_memory_info(self, device):
        return MemoryInfo(total_bytes=1 << 30, free_bytes=1 << 30)


def test_contract_v4_loads_v3_plugins_on_the_reference_state_ops_and_refuses_v2():
    """A plugin implementing no state hook (v2 had none) runs core's reference state ops; v4 loads v3 plugins."""
    assert API_VERSION == 4
    v3 = Backend(_Plugin(3), "v3-plugin")
    assert not any(v3.implements(h) for h in ("pagedllm_allocate_state_cache", "pagedllm_causal_conv1d_fn",
                                              "pagedllm_causal_conv1d_update"))
    spec = MambaSpec(num_layers=3, num_slots=8, shapes=((96, 2),), dtypes=(torch.bfloat16,), device="cpu")
    assert spec.bytes_per_slot == 3 * 96 * 2 * 2
    caches = v3.allocate_state_cache(spec)
    assert len(caches) == 3 and all(c[0].shape == (8, 96, 2) and c[0].dtype == torch.bfloat16 for c in caches)
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    w = torch.randn(96, 3, dtype=torch.bfloat16)
    idx = torch.tensor([5, 0], dtype=torch.int32)
    ref = caches[1][0].clone()
    torch.testing.assert_close(v3.causal_conv1d_update(x, caches[0][0], w, None, None, idx),
                               conv_ops.causal_conv1d_update(x, ref, w, None, None, idx))
    with pytest.raises(BackendError, match=r"contract version 2; this pagedllm implements version 4 "
                                           r"\(accepts 3\.\.4\)"):
        Backend(_Plugin(2), "v2-plugin")
