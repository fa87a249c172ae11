"""The measured batch throttle (spec_decode/throttle.py): per batch-size bucket, speculation stays on where it emits
more tokens per second than plain decoding and goes off where it does not, still trying the other side now and
then; seeded requests are left out of it; ``disable_by_batch_size`` replaces it (vLLM's static rule)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.throttle import EXPLORE_CLOSE, EXPLORE_FAR, EXPLORE_FIRST, WARMUP, BatchThrottle
from eagle_utils import make_bigram_llama

BASE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=512)


def _drive(t: BatchThrottle, batch: int, steps: int, on_cost: float, on_tokens: int) -> list[bool]:
    """Feed ``steps`` synthetic decode steps: plain ones emit ``batch`` tokens in 1 s."""
    out = []
    for _ in range(steps):
        on = t.allow(batch)
        out.append(on)
        t.observe(on_tokens if on else batch, on_cost if on else 1.0, decode_only=True)
    return out


def _probes(cap: int, steps: int) -> list[int]:
    """Step indices (after both warm-ups) of the probes of a side that keeps losing: gaps 8, 16, ... up to ``cap``."""
    out, at, gap = [], 0, EXPLORE_FIRST
    while at + min(gap, cap) <= steps:
        at += min(gap, cap)
        out.append(at - 1)
        gap = 2 * min(gap, cap)
    return out


def test_throttle_follows_the_measured_rates_per_bucket():
    t = BatchThrottle()
    # Batch 1: speculation emits 3 tokens for 1.2 s -> 2.5x the plain rate: on, with off probes after 8, 16, 32, 64
    # steps and then every EXPLORE_FAR.
    n = 2 * EXPLORE_FAR
    d = _drive(t, 1, 2 * WARMUP + n, on_cost=1.2, on_tokens=3)
    assert d[:WARMUP] == [True] * WARMUP and d[WARMUP:2 * WARMUP] == [False] * WARMUP
    assert [i for i, on in enumerate(d[2 * WARMUP:]) if not on] == _probes(EXPLORE_FAR, n) == [7, 23, 55, 119, 247]
    # Batch 64 (another bucket): 80 tokens for 1.5 s loses to 64 tokens in 1 s (53 vs 64 tok/s): off, same probes.
    d = _drive(t, 64, 2 * WARMUP + n, on_cost=1.5, on_tokens=80)
    assert [i for i, on in enumerate(d[2 * WARMUP:]) if on] == _probes(EXPLORE_FAR, n)
    # A near tie (15 vs 16 tok/s in the bucket of 16): the gap stops growing at EXPLORE_CLOSE.
    n = 4 * EXPLORE_CLOSE
    d = _drive(t, 16, 2 * WARMUP + n, on_cost=1.0, on_tokens=15)
    assert [i for i, on in enumerate(d[2 * WARMUP:]) if on] == _probes(EXPLORE_CLOSE, n) == [7, 23, 55, 87, 119]
    assert set(t.rates()) == {1, 5, 7}
    # Steps with prefill work are not compared; the decision of a dropped step leaves the estimates alone.
    before = t.rates()
    t.allow(1)
    t.observe(100, 0.01, decode_only=False)
    assert t.rates() == before


def test_throttle_is_robust_to_stalls_and_follows_a_workload_change():
    """One step stalled 50x (the OS, a garbage collection) does not flip the decision; when the losing side starts to
    win (text that begins to repeat, so n-gram drafts are accepted), a probe that beats the leader is repeated at
    once and the side takes over within a few steps."""
    t = BatchThrottle()
    _drive(t, 1, 2 * WARMUP, on_cost=1.25, on_tokens=1)  # warm-up: nothing to draft yet, proposing costs 25%
    assert t.allow(1) is False
    t.observe(1, 50.0, decode_only=True)  # a stalled plain step
    assert t.rates()[1] == (0.8, 1.0)
    d = _drive(t, 1, 2 * EXPLORE_FIRST + 6, on_cost=1.1, on_tokens=5)  # drafts now land: 4.5x the plain rate
    # Speculation is probed EXPLORE_FIRST steps after the warm-up (the stalled step was the first of them), re-probed
    # while it wins (4 probes: then half of its window of 8 is new and its median leads), and from then on leads,
    # with the plain side probed EXPLORE_FIRST steps later.
    first = d.index(True)
    assert first == EXPLORE_FIRST - 2 and d[first:] == [True] * (4 + EXPLORE_FIRST - 1) + [False] + [True] * 4


def test_measured_throttle_keeps_paying_speculation_on(tmp_path):
    """Greedy decoding of a one-layer bigram model falls into a cycle that n-gram proposals predict exactly: at
    batch 1 speculation emits several tokens per step for about the cost of one, and the throttle keeps it on."""
    model = make_bigram_llama(tmp_path / "m")
    llm = LLM(model, **BASE, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    sp = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    ref = LLM(model, **BASE).generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    on, off = llm.llm_engine.spec.throttle.rates()[1]
    assert on > 1.5 * off
    # Before the cycle there is nothing to match (plain decoding may win those first steps); then drafts emit
    # most of the tokens.
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0.6 * 480


def test_measured_throttle_turns_losing_speculation_off(tiny_llama, tmp_path):
    """A draft model eight times the target's depth that is never right, with the per-request acceptance back-off
    disabled: every speculative step costs far more and emits one token, so the throttle turns it off."""
    from tiny_models import make_tiny_model

    draft = make_tiny_model("llama", tmp_path / "draft", seed=5, num_hidden_layers=16)
    llm = LLM(tiny_llama, **BASE, speculative_config={"model": draft, "num_speculative_tokens": 4,
                                                      "acceptance_threshold": 0.0})
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    ref = LLM(tiny_llama, **BASE).generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    t = llm.llm_engine.spec.throttle
    on, off = t.rates()[1]
    assert off > 1.5 * on and t.steps_off > 5 * t.steps_on


def test_seeded_requests_and_static_rule_bypass_the_measured_throttle(tiny_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    assert LLM(tiny_llama, **BASE, speculative_config={**spec, "disable_by_batch_size": 4}).llm_engine.spec.throttle \
        is None
    llm = LLM(tiny_llama, **BASE, speculative_config=spec)
    t = llm.llm_engine.spec.throttle
    t.allow = lambda n: pytest.fail("a batch of seeded requests consulted the timing-based throttle")
    llm.generate([{"prompt_token_ids": [5, 6, 7, 5, 6]}] * 2,
                 SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.get_stats().spec_decode_num_drafts > 0
