"""LFM2 native vs HF (issue 28): short-convolution layers whose conv state lives in a per-request state slot
(contract v3) beside GQA attention layers with q/k norms. A tiny random config (conv, attention, conv, conv,
attention; kernel 3, conv biases, GQA 3:1, vocab 500): fp32 logits within 1e-4 of HF through the paged cache and the
state slots (full prefill and chunked schedules, reference and CPU backends); greedy parity through the engine with
chunked prefill under a small token budget and mixed prefill/decode batches, under preemption in a tiny KV pool;
n=2 with a seed equal to two single runs; an abort mid-prefill gives the slot and blocks back; the transformers
fallback refuses it at start-up with the reason (the static-shape backend runs it:
tests/plugins/cpu/test_static_state.py); and conformance catches a backend whose conv drops the state between
chunks, kernel case and end to end."""

from __future__ import annotations

import pytest
import torch

from engine_parity import assert_preemption_parity, hf_greedy, mixed_prompts
from logit_parity import assert_schedules_match_hf, hf_eager, parity_prompts
from pagedllm import LLM
from pagedllm.backend import conv_ops
from pagedllm.backend.registry import Backend, get_backend
from pagedllm.conformance import run_conformance
from pagedllm.errors import ParamError, UnsupportedModelError
from pagedllm.models import load_model
from pagedllm.models.lfm2 import Lfm2CausalLM
from plugin_factory import make_plugin
from stateful import LFM2 as CONFIG, LFM2_VOCAB as VOCAB
from stateful import (assert_abort_mid_prefill_releases, assert_dropped_state_changes_logits, assert_greedy_matches,
                      assert_n2_seeded_equals_single_runs, assert_released, random_prompts, stateful_engine)
from tiny_models import save_random_model


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory) -> str:
    return save_random_model(CONFIG, tmp_path_factory.mktemp("lfm2"))


@pytest.mark.parametrize("backend_name", ["ref", "cpu"])
def test_lfm2_logits_match_hf(lfm2_dir, ref_backend, backend_name):
    backend = ref_backend if backend_name == "ref" else get_backend("cpu")
    hf = hf_eager(lfm2_dir)
    ours = load_model(lfm2_dir, backend=backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, Lfm2CausalLM) and (ours.num_layers, ours.num_state_layers) == (2, 3)
    assert ours.state_shapes == ((96, 2),) and ours.state_dtypes == (torch.float32,)
    # 20 and 17 tokens: several blocks of 4, chunks shorter than the kernel
    assert_schedules_match_hf("lfm2", hf, ours, backend, parity_prompts(VOCAB))


def test_lfm2_conv_state_matters(lfm2_dir, ref_backend):
    """The oracle would not notice a dropped state if it did nothing: a chunk that starts fresh instead of
    continuing changes the logits."""
    assert_dropped_state_changes_logits(lfm2_dir, ref_backend, parity_prompts(VOCAB), "lfm2-forgetful",
                                        causal_conv1d_fn=_forgets_state)


def test_lfm2_greedy_parity_chunked_mixed_batches(lfm2_dir, caplog):
    """8 prompts of 1..37 tokens (up to 5 blocks of 8) under a 16-token budget: long prompts are cut into chunks
    that continue their conv state while other sequences decode in the same steps; 24 greedy tokens each equal
    HF's. Prefix caching is turned off for the stateful model, with one log line saying why."""
    with caplog.at_level("INFO", logger="pagedllm.sched.kv_manager"):
        llm = stateful_engine(lfm2_dir, enable_prefix_caching=True)
    assert isinstance(llm.llm_engine.model, Lfm2CausalLM)
    assert not llm.llm_engine.kv.enable_caching and "prefix caching off" in caplog.text
    assert llm.llm_engine.scheduler.swap is None  # stateful requests are preempted by recompute only
    prompts = random_prompts(VOCAB, (1, 2, 7, 9, 16, 17, 23, 37))
    assert_greedy_matches(llm, prompts, 24, lambda p, n: hf_greedy(lfm2_dir, p, n))
    assert_released(llm)


def test_lfm2_greedy_parity_under_preemption(lfm2_dir):
    """10 blocks of 16 for 7 sequences of up to ~40 + 24 tokens: preempted (recompute: the slot is given back and
    the state rebuilt from scratch), still HF's tokens; nothing left held."""
    assert_released(assert_preemption_parity(lfm2_dir, VOCAB, max_len=40))


def test_lfm2_n2_with_seed_equals_two_single_runs(lfm2_dir):
    """n=2 samples share the prompt but not the state slot (no prefix sharing for stateful models): sample i runs
    with seed + i, exactly as a single request with that seed."""
    prompt = mixed_prompts(1, VOCAB, seed=3, max_len=30)[0] + [5] * 20
    assert_n2_seeded_equals_single_runs(stateful_engine(lfm2_dir), prompt, 16)


def test_lfm2_abort_mid_prefill_returns_slot_and_blocks(lfm2_dir):
    assert_abort_mid_prefill_releases(stateful_engine(lfm2_dir, max_num_batched_tokens=8))


def test_lfm2_refused_by_the_fallback_and_speculation(lfm2_dir):
    with pytest.raises(UnsupportedModelError, match="conv"):
        load_model(lfm2_dir, backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"),
                   model_impl="transformers")
    with pytest.raises(ParamError, match=r"speculative_config: Lfm2ForCausalLM keeps recurrent state"):
        LLM(lfm2_dir, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


# ---- conformance: an injected bug in the state carry between chunks -----------------------------------------
def _forgets_state(x, weight, bias, conv_states, query_start_loc, state_indices, has_initial_state, activation):
    """Every chunk starts from zeros (a plausible bug: the kernel never reads the initial state)."""
    return conv_ops.causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, state_indices,
                                     torch.zeros_like(has_initial_state), activation)


def test_conformance_fails_a_conv_that_drops_the_state_between_chunks():
    bad = Backend(make_plugin("lfm2-forgetful-conf", causal_conv1d_fn=_forgets_state), "lfm2-forgetful-conf")
    report = run_conformance(bad, allow=["causal_conv1d_fn.*[dim64-w3-identity|float32]", "state_carry_vs_hf"])
    status = {r.kernel: r.status for r in report.results if r.status != "untested"}
    assert status == {"causal_conv1d_fn.fresh": "passing", "causal_conv1d_fn.continue": "failing",
                      "causal_conv1d_fn.mixed": "failing", "state_carry_vs_hf": "failing"}, status
    e2e = next(r for r in report.results if r.kernel == "state_carry_vs_hf")
    assert "token budget 7" in e2e.error
