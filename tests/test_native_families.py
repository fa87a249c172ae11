"""Native decoders beyond Llama/Mistral/Qwen (Gemma 2 ...) vs HF on odd shapes (``tiny_models.FALLBACK_CONFIGS``):
fp32 logits within 1e-4 through the paged cache, greedy parity through the engine, and the transformers fallback of
the same checkpoint agreeing with the native path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_parity import assert_engine_parity
from pagedllm.models import CausalLM, load_model
from test_models import CHUNKED, FULL_PREFILL, _prompts, assert_logits_match, run_schedule
from tiny_models import make_fallback_model

NATIVE = ["gemma2"]


@pytest.fixture(scope="module")
def native_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("native_families")
    return {name: make_fallback_model(name, root / name) for name in NATIVE}


def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", NATIVE)
def test_native_logits_match_hf(native_dirs, ref_backend, name):
    path = native_dirs[name]
    hf = _hf(path)
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, CausalLM)
    prompts = _prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(name, run_schedule(ours, ref_backend, prompts, schedule), expected)


@pytest.mark.parametrize("name", NATIVE)
def test_native_greedy_parity_engine(native_dirs, name):
    """>= 32 greedy tokens, batch 8 of lengths 1..37 (past block 16 and window 8), chunked prefill, prefix hits."""
    path = native_dirs[name]
    llm = assert_engine_parity(path, _hf(path))
    assert isinstance(llm.llm_engine.model, CausalLM)
