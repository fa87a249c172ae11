"""The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1): greedy parity with HF loading the same file."""

from __future__ import annotations

import pytest

from hf_oracle import hf_greedy
from pagedllm import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, device="cpu", dtype="float32", max_model_len=512, kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def hf(smollm2_hf):
    """HF transformers' float32 model of the same GGUF (conftest: loaded once per session)."""
    return smollm2_hf


def test_greedy_32_tokens_equal_hf_from_same_gguf(llm, hf):
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_greedy(hf, tok.encode(prompt), 32)
        assert out.outputs[0].token_ids == ref, prompt
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
    assert llm.llm_engine.kv.num_used_blocks == 0


def test_chat_uses_template_and_stops_at_eos(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2? Answer with one number."}],
                   SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert "<|im_start|>assistant" in tok.decode(out.prompt_token_ids)
    assert out.outputs[0].finish_reason == "stop" and "4" in out.outputs[0].text
