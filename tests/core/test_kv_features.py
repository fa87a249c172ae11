"""KV memory features (issue 3): prefix caching, parallel sampling sharing, swap preemption, priority, utilisation."""

from __future__ import annotations

import random

import pytest
import torch

import tiny_models
from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> str:
    """The tiny Llama with room for 1024 positions (a 512-token shared prefix plus suffixes and outputs)."""
    return tiny_models.make_tiny_model("llama", tmp_path_factory.mktemp("long_llama"), max_position_embeddings=1024)


def make_llm(path, **kw):
    kw.setdefault("kv_cache_memory", 64 << 20)
    kw.setdefault("max_model_len", 1024)
    return LLM(path, device="cpu", dtype="float32", **kw)


def rand_ids(g, n):
    return torch.randint(3, 512, (n,), generator=g).tolist()


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_no_leak(llm):
    eng = llm.llm_engine
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished_requests()
    if eng.scheduler.swap is not None:
        assert eng.scheduler.swap.num_free == eng.scheduler.swap.num_blocks


def test_shared_prefix_is_computed_once_and_outputs_match_caching_off(long_llama):
    g = torch.Generator().manual_seed(0)
    prefix = rand_ids(g, 512)
    prompts = [{"prompt_token_ids": prefix + rand_ids(g, 8)} for _ in range(32)]
    total = sum(len(p["prompt_token_ids"]) for p in prompts)
    on, off = make_llm(long_llama), make_llm(long_llama, enable_prefix_caching=False)
    out_on, out_off = on.generate(prompts, greedy(), use_tqdm=False), off.generate(prompts, greedy(), use_tqdm=False)
    assert tokens(out_on) == tokens(out_off)
    s_on, s_off = on.llm_engine.get_stats(), off.llm_engine.get_stats()
    assert s_off.computed_prompt_tokens == total
    # The prefix is computed once; the other 31 requests compute only their 8-token suffix.
    assert s_on.computed_prompt_tokens == 520 + 31 * 8
    assert s_on.prefix_hits == 31 * 512 and s_on.prefix_queries == total
    assert sum(o.num_cached_tokens for o in out_on) == 31 * 512
    assert_no_leak(on)
    assert_no_leak(off)


def test_parallel_sampling_shares_prompt_blocks_and_equals_independent_seeded_requests(long_llama):
    g = torch.Generator().manual_seed(1)
    prompt = {"prompt_token_ids": rand_ids(g, 200)}  # 12 full blocks + 8 tokens
    sp = SamplingParams(n=4, temperature=0.8, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True)
    llm = make_llm(long_llama)
    eng = llm.llm_engine
    eng.add_request("p", prompt, sp)
    peak = 0
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
        peak = max(peak, eng.kv.num_used_blocks)
    assert final.finished and len(final.outputs) == 4
    # Shared: 12 full prompt blocks once; per sample only its own tail (8 prompt + 20 generated tokens = 2 blocks).
    assert peak == 12 + 4 * 2 < 4 * 13
    # The same samples as 4 independent requests with the child seeds (seed + index, as vLLM does).
    singles = [llm.generate([prompt], sp.clone(n=1, best_of=None, seed=7 + i), use_tqdm=False)[0].outputs[0].token_ids
               for i in range(4)]
    assert [c.token_ids for c in final.outputs] == singles
    assert len({tuple(t) for t in singles}) > 1  # really different samples
    assert_no_leak(llm)


def test_greedy_n_samples_are_identical_and_best_of_returns_n(long_llama):
    llm = make_llm(long_llama)
    out = llm.generate([{"prompt_token_ids": list(range(5, 40))}], greedy(8, n=3), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) == 1
    sp = SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": list(range(5, 40))}], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    assert_no_leak(llm)


def test_swap_preemption_resumes_with_identical_output(long_llama):
    g = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": rand_ids(g, n)} for n in (40, 55, 70, 33, 61, 48)]
    ref = tokens(make_llm(long_llama).generate(prompts, greedy(40), use_tqdm=False))
    # 14 blocks of 16 for 6 sequences reaching ~80-110 tokens: preemption is unavoidable; 4 MiB of host swap.
    small = make_llm(long_llama, kv_cache_memory=None, num_gpu_blocks_override=14, max_model_len=128,
                     swap_space=4 / 1024)
    got = tokens(small.generate(prompts, greedy(40), use_tqdm=False))
    stats = small.llm_engine.get_stats()
    assert stats.num_swaps > 0 and stats.num_preemptions >= stats.num_swaps
    assert got == ref
    assert_no_leak(small)


def test_recompute_is_chosen_when_no_swap_space(long_llama):
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": rand_ids(g, n)} for n in (40, 55, 70, 33, 61, 48)]
    llm = make_llm(long_llama, kv_cache_memory=None, num_gpu_blocks_override=14, max_model_len=128)
    llm.generate(prompts, greedy(40), use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_swaps == 0
    assert_no_leak(llm)


def test_priority_policy_runs_urgent_request_first(long_llama):
    llm = make_llm(long_llama, scheduling_policy="priority", max_num_seqs=1)
    eng = llm.llm_engine
    eng.add_request("low", {"prompt_token_ids": list(range(5, 25))}, greedy(30, priority=10))
    eng.step()  # low is running
    eng.add_request("high", {"prompt_token_ids": list(range(30, 50))}, greedy(5, priority=0))
    finished = []
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step() if o.finished]
    assert finished == ["high", "low"]  # high preempted low although low arrived first
    assert eng.get_stats().num_preemptions == 1
    assert_no_leak(llm)


def test_kv_slot_utilisation_on_mixed_lengths(long_llama):
    rnd = random.Random(4)
    g = torch.Generator().manual_seed(4)
    n = 24
    prompts = [{"prompt_token_ids": rand_ids(g, rnd.randint(32, 256))} for _ in range(n)]
    params = [greedy(rnd.randint(16, 512)) for _ in range(n)]
    llm = make_llm(long_llama, max_num_seqs=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    s = llm.llm_engine.get_stats()
    paged = s.slot_steps_live / s.slot_steps_allocated
    # Contiguous max-length preallocation would reserve max_model_len slots for each running sequence.
    contiguous = s.slot_steps_live / (s.slot_steps_seqs * llm.llm_engine.max_model_len)
    print(f"KV slot utilisation: paged {paged:.4f}, contiguous max-length preallocation {contiguous:.4f}")
    assert paged >= 0.97 and contiguous < 0.5
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(outs, params))
    assert_no_leak(llm)
