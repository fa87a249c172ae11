"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``) equal HF's log_softmax at every prompt position."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams


@pytest.mark.parametrize("budget", [None, 16])  # whole prompt in one step, and chunked over several steps
def test_prompt_logprobs_match_hf(tiny_llama, budget):
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=budget)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (40, 9, 1)]
    # The first run fills the prefix cache; prompt-logprob requests must still compute every position.
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for p, out in zip(prompts, outs):
        plp = out.prompt_logprobs
        assert len(plp) == len(p) and plp[0] is None
        with torch.inference_mode():
            ref = hf(torch.tensor([p])).logits[0].float().log_softmax(-1)
        for i in range(1, len(p)):
            d = plp[i]
            assert p[i] in d and 3 <= len(d) <= 4
            assert d[p[i]].logprob == pytest.approx(float(ref[i - 1, p[i]]), abs=1e-4)
            assert d[p[i]].rank == int((ref[i - 1] > ref[i - 1, p[i]]).sum()) + 1
            top = ref[i - 1].topk(3)
            for rank, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
                assert d[t].logprob == pytest.approx(v, abs=1e-4) and d[t].rank == rank
    assert llm.llm_engine.kv.num_used_blocks == 0


def test_prompt_logprobs_survive_preemption(tiny_llama):
    """Recompute after preemption must not record a prompt position twice."""
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks_override=10)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (45, 38, 50, 41)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for p, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(p)
        assert all(list(d) == [t] for d, t in zip(out.prompt_logprobs[1:], p[1:]))
