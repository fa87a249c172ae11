"""The measured batch throttle (spec_decode/throttle.py): per batch-size bucket, speculation stays on where it emits
more tokens per second than plain decoding and goes off where it does not, still trying the other side now and
then; seeded requests are left out of it; ``disable_by_batch_size`` replaces it (vLLM's static rule)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.throttle import EXPLORE_CLOSE, EXPLORE_FAR, WARMUP, BatchThrottle
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


def test_throttle_follows_the_measured_rates_per_bucket():
    t = BatchThrottle()
    # Batch 1: speculation emits 3 tokens for 1.2 s -> 2.5x the plain rate: on, with an off probe every EXPLORE_FAR.
    d = _drive(t, 1, 2 * WARMUP + 2 * EXPLORE_FAR, on_cost=1.2, on_tokens=3)
    assert d[:WARMUP] == [True] * WARMUP and d[WARMUP:2 * WARMUP] == [False] * WARMUP
    assert d[2 * WARMUP:].count(False) == 2
    # Batch 64 (another bucket): 80 tokens for 1.5 s loses to 64 tokens in 1 s: off, probing on every
    # EXPLORE_CLOSE while the rates are within 10% of each other... here they are not (53 vs 64 tok/s): EXPLORE_FAR.
    d = _drive(t, 64, 2 * WARMUP + 2 * EXPLORE_FAR, on_cost=1.5, on_tokens=80)
    assert d[2 * WARMUP:].count(True) == 2
    # A near tie (62 vs 64 tok/s): probes every EXPLORE_CLOSE steps.
    d = _drive(t, 16, 2 * WARMUP + 4 * EXPLORE_CLOSE, on_cost=1.0, on_tokens=15)  # bucket of 16: plain 16 tok/s
    assert d[2 * WARMUP:].count(True) == 4
    assert set(t.rates()) == {1, 5, 7}
    # Steps with prefill work are not compared; the decision of a dropped step leaves the estimates alone.
    before = t.rates()
    t.allow(1)
    t.observe(100, 0.01, decode_only=False)
    assert t.rates() == before


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
