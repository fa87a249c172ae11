"""Greedy-parity helpers shared by the engine, static-shape, contract and plugin end-to-end tests: HF's greedy
tokens for a model folder (the model loaded once), reproducible mixed-length prompts, and one greedy engine run that
must leave no KV block or request behind."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM

import hf_oracle
from pagedllm import LLM, SamplingParams

MAX_TOKENS = 12


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    return hf_oracle.hf_greedy(hf_model(path), prompt, n)


def mixed_prompts(num: int, vocab: int, seed: int, max_len: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len, (num,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def run(llm: LLM, prompts, max_tokens=MAX_TOKENS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.kv.num_used_blocks == 0, "KV blocks leaked"
    assert not llm.llm_engine.has_unfinished_requests()
    return [o.outputs[0].token_ids for o in outs]


def assert_preemption_parity(path: str, vocab: int, max_len: int, enable_prefix_caching: bool = True) -> LLM:
    """HF's greedy tokens when the pool is too small for the batch: 10 blocks of 16 (160 slots) for 7 sequences of
    up to ``max_len`` + 24 tokens, so requests are preempted and recomputed (asserted)."""
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks_override=10,
              enable_prefix_caching=enable_prefix_caching)
    prompts = mixed_prompts(7, vocab, seed=4, max_len=max_len)
    got = run(llm, prompts, max_tokens=24)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert got == [hf_greedy(path, p, 24) for p in prompts]
    return llm
