"""The per-family acceptance oracle of issue 13, shared by the fallback, MoE and native-family tests.

Greedy parity with HF for >= 32 new tokens on a mixed batch of 8 (lengths 1 to past a block boundary and past an
8-token sliding window), with chunked prefill (a 16-token budget splits the long prompts) and prefix caching on: a
second wave reuses the first wave's prompts as prefixes, so it must hit the cache and still match token for token.
"""

from __future__ import annotations

import random

import torch

import hf_oracle
from pagedllm import LLM, SamplingParams

NEW_TOKENS = 32


def mixed_batch(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(first wave, second wave): lengths 1, 2, 7, 9, 16, 17, 23, 37; the second extends first-wave prompts."""
    rng = random.Random(seed)
    first = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 2, 7, 9, 16, 17, 23, 37)]
    second = [first[i] + [rng.randrange(3, vocab) for _ in range(k)] for i, k in ((4, 3), (5, 1), (6, 12), (7, 20))]
    second += [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 19)]
    return first, second


def engine_outputs(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.kv.num_used_blocks == 0, "KV blocks leaked"
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_engine_parity(path: str, hf_model, seed: int = 0, **llm_kwargs) -> LLM:
    """Both waves through one engine (block 16, 16-token budget, prefix caching) equal HF's greedy tokens."""
    kwargs = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20, block_size=16,
                  max_num_batched_tokens=16, enable_prefix_caching=True)
    llm = LLM(path, **{**kwargs, **llm_kwargs})
    first, second = mixed_batch(hf_model.config.vocab_size, seed)
    for wave in (first, second):
        expected = [hf_oracle.hf_greedy(hf_model, p, NEW_TOKENS) for p in wave]
        got = engine_outputs(llm, wave)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"prompt {i} (len {len(wave[i])}): engine {g} != HF {e}"
    assert llm.llm_engine.get_stats().prefix_hits > 0, "the second wave should reuse cached prefix blocks"
    return llm
