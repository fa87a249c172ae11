"""Native decoders beyond Llama/Mistral/Qwen -- Phi-3 (fused checkpoint tensors, LongRoPE), Gemma 2, Gemma 3 text,
and Yi (a Llama checkpoint with Yi's shapes, which loads as Llama) -- vs HF on odd shapes (``tiny_models``): fp32
logits within 1e-4 through the paged cache, and greedy parity through the engine."""

from __future__ import annotations

import pytest
import torch

from model_parity import assert_engine_parity
from pagedllm.models import CausalLM, load_model
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, family_dirs, hf_eager, parity_prompts, run_schedule

NATIVE = ["phi3", "gemma2", "gemma3", "yi"]


@pytest.fixture(scope="module")
def native_dirs(tmp_path_factory) -> dict[str, str]:
    return family_dirs(tmp_path_factory, "native_families", NATIVE + ["phi3_longrope"])


@pytest.mark.parametrize("name", NATIVE)
def test_native_logits_match_hf(native_dirs, ref_backend, name):
    path = native_dirs[name]
    hf = hf_eager(path)
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, CausalLM)
    assert ours.head_size == 48 and (ours.num_heads, ours.num_kv_heads) == (10, 2)
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(name, run_schedule(ours, ref_backend, prompts, schedule), expected)


@pytest.mark.parametrize("name", NATIVE)
def test_native_greedy_parity_engine(native_dirs, name):
    """>= 32 greedy tokens, batch 8 of lengths 1..37 (past block 16 and window 8), chunked prefill, prefix hits."""
    path = native_dirs[name]
    llm = assert_engine_parity(path, hf_eager(path))
    assert isinstance(llm.llm_engine.model, CausalLM)


def test_phi3_longrope_short_and_long_factors(native_dirs, ref_backend):
    """Up to original_max_position_embeddings (64) the short factors, as HF; past it, the long ones for every
    position, as HF uses for a sequence that runs past 64 in one forward."""
    path = native_dirs["phi3_longrope"]
    hf = hf_eager(path)
    prompts = parity_prompts(hf.config.vocab_size)
    long_prompt = [[(7 * i) % 400 + 3 for i in range(90)]]
    with torch.inference_mode():
        short = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"), max_model_len=64)
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match("phi3 short", run_schedule(short, ref_backend, prompts, schedule), expected)
        long = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
        assert not torch.equal(long.cos_sin_cache[:64], short.cos_sin_cache[:64])
        got = run_schedule(long, ref_backend, long_prompt, [[(0, 90)]])
        assert_logits_match("phi3 long", got, [hf(torch.tensor(long_prompt)).logits[0]])
