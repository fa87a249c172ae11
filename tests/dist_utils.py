"""Helpers for the distributed tests: tiny models with the shapes TP must handle, mixed workloads, logits capture."""

from __future__ import annotations

import os

import torch

import tiny_models
from pagedllm import LLM, SamplingParams

# Odd shapes on purpose: a vocabulary two ranks do not divide (509), and one kv head for two ranks (replicated).
DIST_MODELS = {"llama": ("llama", dict(vocab_size=509)), "qwen3": ("qwen3", dict(num_key_value_heads=1))}


def make_dist_model(name: str, root) -> str:
    arch, over = DIST_MODELS[name]
    path = os.path.join(str(root), name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        tiny_models.make_tiny_model(arch, path, **over)
    return path


def workload(seed: int = 1, num: int = 10) -> list[list[int]]:
    """Mixed lengths: decodes batched with chunked prefills at a 48-token budget."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 90, (num,), generator=g).tolist()
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def prefix_workload(prompts: list[list[int]]) -> list[list[int]]:
    """Prompts that share their first 48 tokens with the longest of ``prompts`` (prefix-cache hits when run after
    them)."""
    longest = max(prompts, key=len)
    return [longest[:48] + [7, 8, 9], longest[:48] + [10, 11]]


def engine(path: str, tp: int = 1, pp: int = 1, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=128,
               max_num_batched_tokens=48, max_num_seqs=8, enable_prefix_caching=True, skip_tokenizer_init=True,
               tensor_parallel_size=tp, pipeline_parallel_size=pp, **kw)


def run_capturing_logits(llm: LLM, prompts: list[list[int]], max_tokens: int = 6):
    """Greedy outputs, and every step's float32 logits as the driver's runner received them."""
    runner = llm.llm_engine.worker.runner
    inner, logits = runner.forward_logits, []

    def capture(*args):
        out = inner(*args)
        if out is not None:
            logits.append(out.clone())
        return out

    runner.forward_logits = capture
    try:  # with prompt logprobs (every prompt position's logits), then prompts that hit the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=1),
                            use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": p} for p in prefix_workload(prompts)],
                             SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        runner.forward_logits = inner
    assert llm.llm_engine.kv.num_used_blocks == 0, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs], logits
