"""The static-shape path (buckets, padding to a sink block, warm-up, replay from persistent buffers, on-device
sampling) run for real through the ``cpu-static`` backend, against HF transformers and the dynamic ``cpu`` backend."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.backend.batch_policy import BatchShape, BucketPolicy, capped_pow2_buckets
from pagedllm.backend.device_sampler import SamplingTensors, sample
from pagedllm.sample.sampler import top_k_top_p_cutoff
from engine_parity import hf_greedy, mixed_prompts, run

STATIC = dict(device="cpu-static", dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)


def test_every_real_shape_pads_into_the_warmup_set():
    policy = BucketPolicy(capped_pow2_buckets(64, 8), capped_pow2_buckets(8), capped_pow2_buckets(8), block_size=16)
    warm = set(policy.warmup_shapes())
    padded = set()
    for t, s, w in itertools.product(range(1, 65), range(1, 9), range(1, 9)):
        if s <= t <= s * w * 16:
            padded.add(policy.pad(BatchShape(t, s, w)))
    assert padded <= warm  # nothing a step can pad to is left cold
    assert len(warm) <= 4 * 4 * 4
    with pytest.raises(ValueError, match="num_tokens 65 exceeds the largest bucket 64"):
        policy.pad(BatchShape(65, 1, 1))


def test_capped_pow2_buckets_are_powers_of_two_then_the_cap():
    assert capped_pow2_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert capped_pow2_buckets(64, 8) == (8, 16, 32, 64) and capped_pow2_buckets(5, 8) == (5,)
    with pytest.raises(ValueError, match="power of two"):
        capped_pow2_buckets(100, 3)
    with pytest.warns(DeprecationWarning, match="capped_pow2_buckets"):
        from pagedllm.backend.batch_policy import pow2_buckets

        assert pow2_buckets(100) == capped_pow2_buckets(100)  # the old name, same buckets


def _record_shapes(llm: LLM) -> list:
    seen: list = []
    llm.llm_engine.model.register_forward_pre_hook(
        lambda mod, args: seen.append((args[0].shape[0], args[2].seq_lens.shape[0], args[2].block_tables.shape[1])))
    return seen


@pytest.mark.parametrize("name", ["llama", "qwen2_swa"])
def test_static_mode_greedy_parity_with_chunked_prefill_and_preemption(tiny_model_dirs, name):
    path = tiny_model_dirs[name]
    # 12 blocks of 16 for 7 prompts of up to 50 tokens + 12: preemption; a 64-token budget: chunked prefill.
    llm = LLM(path, num_gpu_blocks_override=12, **STATIC)
    worker = llm.llm_engine.worker
    warm = set(worker.policy.warmup_shapes())
    captures = worker.graph_stats["captures"]
    assert captures == 2 * len(warm)  # forward and forward+sampling, every bucket, before the first request
    seen = _record_shapes(llm)
    prompts = mixed_prompts(7, 512, seed=4, max_len=50)
    assert run(llm, prompts) == [hf_greedy(path, p, 12) for p in prompts]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert set(seen) <= warm and len(set(seen)) <= len(warm)
    assert worker.graph_stats["captures"] == captures  # nothing compiled while serving
    # Padding wrote only to the sink block, which the pool never hands out.
    assert worker.sink_block == llm.llm_engine.kv.pool.num_blocks == worker.num_blocks
    assert llm.llm_engine.kv_caches[0].shape[1] == worker.num_blocks + 1


def test_static_mode_equals_dynamic_for_host_sampled_rows(tiny_model_dirs):
    """Rows that need the host sampler (logprobs, seeds, penalties) take the forward-only program; their outputs
    equal the dynamic backend's exactly, in a batch with device-sampled greedy rows."""
    path = tiny_model_dirs["llama"]
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(5, 512, seed=7, max_len=40)]
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.3, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]

    def outputs(device: str):
        llm = LLM(path, **{**STATIC, "device": device})
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [sorted(d) for d in (o.outputs[0].logprobs or [])]) for o in outs]

    assert outputs("cpu-static") == outputs("cpu")


def test_device_sampler_follows_the_host_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    t = SamplingTensors(temperature=torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 1.0]),
                        top_k=torch.tensor([0, 5, 0, 3, 1, 0]),
                        top_p=torch.tensor([1.0, 1.0, 0.6, 0.9, 1.0, 1.0]),
                        min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.2]))
    scaled = logits / t.temperature.clamp(min=1e-5)[:, None]
    cut = top_k_top_p_cutoff(scaled.clone(), torch.where(t.top_k > 0, t.top_k, 50), t.top_p)
    allowed = scaled >= cut[:, None]
    probs = scaled.softmax(-1)
    allowed[5] = probs[5] >= 0.2 * probs[5].max()
    counts = torch.zeros(6, 50)
    for _ in range(400):
        tok = sample(logits, t, g)
        counts[torch.arange(6), tok] += 1
    assert counts[0, logits[0].argmax()] == 400 and counts[4, logits[4].argmax()] == 400  # greedy, top_k=1
    assert bool((counts[~allowed] == 0).all())  # never a token outside top-k / top-p / min-p
    # Within the allowed set the frequencies follow the renormalised distribution (row 1: top-5 of 50).
    want = torch.where(allowed[1], probs[1], 0.0)
    want = want / want.sum()
    assert (counts[1] / 400 - want).abs().max() < 0.08
