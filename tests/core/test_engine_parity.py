"""End-to-end greedy parity with HF transformers (fp32) through the whole engine on the CPU backend.

The oracle is HF's own model run token by token with its KV cache (argmax each step), one prompt at a time, so
batching, chunked prefill, preemption and prefix caching in pagedllm must not change a single token.
"""

from __future__ import annotations

import pytest

from engine_parity import MAX_TOKENS, assert_preemption_parity, hf_greedy, mixed_prompts, run
from pagedllm import LLM


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen2_swa", "qwen3"])
def test_greedy_parity_batch_1_and_7(tiny_model_dirs, name):
    path = tiny_model_dirs[name]
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)
    prompts = mixed_prompts(8, 512, seed=1)
    expected = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    assert run(llm, prompts[:1]) == expected[:1]
    assert run(llm, prompts[1:]) == expected[1:]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_greedy_parity_batch_64_mixed_lengths(tiny_model_dirs, name):
    path = tiny_model_dirs[name]
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=64 << 20)
    prompts = mixed_prompts(64, 512, seed=2)
    assert run(llm, prompts) == [hf_greedy(path, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_greedy_parity_with_tiny_chunked_prefill_budget(tiny_model_dirs, name):
    path = tiny_model_dirs[name]
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=32 << 20,
              max_num_batched_tokens=16)
    prompts = mixed_prompts(7, 512, seed=3, max_len=50)
    assert run(llm, prompts) == [hf_greedy(path, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_parity_under_preemption(tiny_model_dirs, caching):
    assert_preemption_parity(tiny_model_dirs["llama"], 512, max_len=50, enable_prefix_caching=caching)


def test_repeated_prompts_hit_prefix_cache_and_stay_exact(tiny_model_dirs):
    path = tiny_model_dirs["qwen2"]
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)
    prompts = mixed_prompts(4, 512, seed=5, max_len=60)
    first = run(llm, prompts)
    before = llm.llm_engine.get_stats().computed_prompt_tokens
    assert run(llm, prompts) == first == [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    recomputed = llm.llm_engine.get_stats().computed_prompt_tokens - before
    assert recomputed < sum(len(p) for p in prompts) / 2  # most of the prompts came from the cache
