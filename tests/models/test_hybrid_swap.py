"""Swap preemption of recurrent state (issue 28): with ``swap_space`` a stateful request preempted under a tiny KV
pool takes its state slot to host memory with its K/V blocks and comes back into a (possibly different) device slot
mid-sequence, instead of recomputing. Tiny LFM2 (conv + attention), Qwen3-Next (Gated DeltaNet + attention) and pure
Mamba2 (state only: its blocks cost nothing but still bound the batch): HF's greedy tokens, swaps counted (blocks and
state slots), nothing left held (device and host slots, device and host blocks); LFM2 on the static-shape backend
(cpu-static) too. Removing the state copy on swap-in
breaks parity, so the test does see the state move."""

from __future__ import annotations

import pytest

from engine_parity import mixed_prompts, run
from hf_recompute import hf_greedy_recompute as hf_greedy
from pagedllm import LLM, SamplingParams
from pagedllm.worker import state_swap
from stateful import LFM2, LFM2_VOCAB, MAMBA2, MAMBA2_VOCAB, QWEN3_NEXT, QWEN3_NEXT_VOCAB
from tiny_models import save_random_model

FAMILIES = {"lfm2": (LFM2, LFM2_VOCAB), "qwen3_next": (QWEN3_NEXT, QWEN3_NEXT_VOCAB),
            "mamba2": (MAMBA2, MAMBA2_VOCAB)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid_swap")
    return {name: save_random_model(cfg, root / name) for name, (cfg, _) in FAMILIES.items()}


def _swap_engine(path: str, device: str = "cpu") -> LLM:
    """10 blocks of 16 for 7 sequences of up to ~40 + 24 tokens, 16 MiB of host swap space."""
    return LLM(path, device=device, dtype="float32", max_model_len=128, num_gpu_blocks_override=10, max_num_seqs=8,
               swap_space=1 / 64)


def _record_swaps(llm: LLM) -> dict[str, list]:
    """Spy on the worker's swaps (each call still runs): the state pairs of every swap-out and swap-in."""
    worker, seen = llm.llm_engine.worker, {"out": [], "in": []}
    real = worker.swap

    def swap(src_to_dst, out, state=()):
        seen["out" if out else "in"].extend(state)
        return real(src_to_dst, out, state)

    worker.swap = swap
    return seen


def _assert_released(llm: LLM) -> None:
    eng = llm.llm_engine
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished_requests(), "KV blocks leaked"
    slots = eng.kv.state_slots
    assert slots.num_free == slots.num_slots and not slots.owner, "state slots leaked"
    host = eng.kv.state_swap.host
    assert host.num_free == host.num_slots and not host.owner, "host state slots leaked"
    assert eng.scheduler.swap.num_free == eng.scheduler.swap.num_blocks, "host blocks leaked"


@pytest.mark.parametrize("family,device", [(f, "cpu") for f in FAMILIES] + [("lfm2", "cpu-static")])
def test_swap_preemption_carries_state(dirs, family, device):
    """cpu-static: the swapped-in request's new slot reaches the static runner's bucket buffers too."""
    path, vocab = dirs[family], FAMILIES[family][1]
    llm = _swap_engine(path, device)
    eng = llm.llm_engine
    assert eng.scheduler.swap is not None and eng.kv.state_swap is not None
    assert eng.worker.num_host_state_slots == eng.kv.state_slots.num_slots  # 16 MiB holds a slot per sequence
    seen = _record_swaps(llm)
    prompts = mixed_prompts(7, vocab, seed=4, max_len=40)
    got = run(llm, prompts, max_tokens=24)
    assert eng.scheduler.num_swaps > 0 and len(seen["out"]) == eng.scheduler.num_swaps
    assert sorted(h for _, h in seen["out"]) == sorted(h for h, _ in seen["in"])  # every swapped state came back
    assert got == [hf_greedy(path, tuple(p), 24) for p in prompts]
    _assert_released(llm)


def test_swap_without_the_state_copy_is_wrong(dirs, monkeypatch):
    """The same LFM2 run with the host -> device state copy dropped (an injected bug): the resumed requests read
    whatever their new slot holds, and greedy parity breaks."""
    path = dirs["lfm2"]
    real = state_swap.copy_state_slots

    def out_only(src, dst, pairs):
        if dst is llm.llm_engine.worker.host_state_caches:
            real(src, dst, pairs)

    monkeypatch.setattr("pagedllm.worker.worker.copy_state_slots", out_only)
    llm = _swap_engine(path)
    prompts = mixed_prompts(7, LFM2_VOCAB, seed=4, max_len=40)
    got = run(llm, prompts, max_tokens=24)
    assert llm.llm_engine.scheduler.num_swaps > 0
    assert got != [hf_greedy(path, tuple(p), 24) for p in prompts]


def test_too_little_swap_space_for_a_state_slot_recomputes(dirs, caplog):
    """A swap space smaller than one state slot gives no host pool at all: preemption recomputes (logged)."""
    with caplog.at_level("WARNING", logger="pagedllm.worker.state_swap"):
        llm = LLM(dirs["mamba2"], device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks_override=10,
                  max_num_seqs=8, swap_space=1 / (1 << 30))
    assert "holds no recurrent-state slot" in caplog.text
    assert llm.llm_engine.scheduler.swap is None and llm.llm_engine.kv.state_swap is None


def test_abort_while_swapped_out_returns_the_host_slot(dirs):
    """A request aborted while its state sits in a host slot gives that slot and its host blocks back; the others
    finish with HF's tokens and nothing stays held."""
    path = dirs["lfm2"]
    llm = _swap_engine(path)
    eng = llm.llm_engine
    prompts = mixed_prompts(7, LFM2_VOCAB, seed=4, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    swapped = None
    while swapped is None and eng.has_unfinished_requests():
        eng.step()
        swapped = next((r.request_id for r in eng.scheduler.waiting if r.swapped_blocks is not None), None)
    assert swapped is not None and eng.kv.state_swap.is_swapped(swapped)
    eng.abort_request(swapped)
    assert not eng.kv.state_swap.is_swapped(swapped)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    for i, p in enumerate(prompts):
        if f"r{i}" != swapped:
            assert done[f"r{i}"] == hf_greedy(path, tuple(p), 24)
    _assert_released(llm)
