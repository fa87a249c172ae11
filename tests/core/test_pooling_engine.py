"""The pooling runner inside the engine: chunked prefill pools the same as one step, blocks are freed the moment a
pooling request finishes, the runner refuses what it does not run (naming the flag), and ``AsyncLLM.encode`` carries
pooling requests across the engine process (one engine and data parallel)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.errors import ParamError
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

BASE = dict(device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=16 << 20)
LONG = list(range(3, 50))  # 47 tokens: six chunks at a budget of 8
PROMPTS = [LONG, [5, 6, 7], list(range(100, 121))]


def run(engine: LLMEngine, prompts, params) -> list[PoolingRequestOutput]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("pooling_type,task", [("LAST", "embed"), ("MEAN", "embed"), ("CLS", "embed"),
                                               ("LAST", "encode")])
def test_chunked_prefill_pools_the_same(tiny_llama, pooling_type, task):
    params = PoolingParams(task=task)
    outs = {}
    for budget in (8, 512):
        engine = LLMEngine(EngineConfig(tiny_llama, runner="pooling", max_num_batched_tokens=budget,
                                        pooler_config={"pooling_type": pooling_type}, **BASE))
        outs[budget] = run(engine, PROMPTS, params)
        st = engine.get_stats()
        assert st.num_steps >= (6 if budget == 8 else 1)
        assert (st.num_used_blocks, st.num_running, st.num_waiting) == (0, 0, 0)  # every block back at once
        engine.shutdown()
    for a, b in zip(outs[8], outs[512]):
        assert a.finished and a.prompt_token_ids == b.prompt_token_ids
        assert a.outputs.data.device.type == "cpu" and not a.outputs.data.is_inference()  # a plain host tensor
        torch.testing.assert_close(a.outputs.data, b.outputs.data, atol=1e-5, rtol=1e-5)
    if task == "encode":  # every token's hidden state
        assert outs[8][0].outputs.data.shape == (len(LONG), 256)


def test_preemption_by_recompute_pools_the_same(tiny_llama):
    """A request preempted mid-prompt (recompute) pools its prompt again from the start, counting no row twice."""
    params = PoolingParams(task="embed", normalize=False)
    urgent = list(range(60, 107))
    ref = LLMEngine(EngineConfig(tiny_llama, runner="pooling", pooler_config={"pooling_type": "MEAN"}, **BASE))
    want = run(ref, [LONG, urgent], params)
    ref.shutdown()
    # four blocks of 16: the long prompt's first 40 tokens take three, so the urgent one (priority 0) can only
    # start by preempting it
    engine = LLMEngine(EngineConfig(tiny_llama, runner="pooling", pooler_config={"pooling_type": "MEAN"},
                                    max_num_batched_tokens=40, num_gpu_blocks_override=4, block_size=16,
                                    scheduling_policy="priority", enable_prefix_caching=False,
                                    **{k: v for k, v in BASE.items() if k != "kv_cache_memory"}))
    engine.add_request("r0", {"prompt_token_ids": LONG}, params, priority=1)
    done = {o.request_id: o for o in engine.step()}
    engine.add_request("r1", {"prompt_token_ids": urgent}, params, priority=0)
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    st = engine.get_stats()
    assert st.num_preemptions == 1 and st.num_used_blocks == 0
    engine.shutdown()
    for rid, w in zip(("r0", "r1"), want):
        torch.testing.assert_close(done[rid].outputs.data, w.outputs.data, atol=1e-5, rtol=1e-5)


def test_blocks_freed_at_finish_and_prefix_cache(tiny_llama):
    engine = LLMEngine(EngineConfig(tiny_llama, runner="pooling", max_num_batched_tokens=16, **BASE))
    engine.add_request("a", {"prompt_token_ids": LONG}, PoolingParams())
    engine.add_request("b", {"prompt_token_ids": PROMPTS[2]}, PoolingParams())
    used = []
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
        used.append(engine.get_stats().num_used_blocks)
        if "b" in finished and "a" not in finished:  # b finished this step while a still runs: only a's blocks
            assert used[-1] == engine.kv.num_blocks_of("a") > 0
    assert used[-1] == 0 and max(used) > 0
    # LAST pooling may reuse the prefix cache (the last token always runs): the same embedding
    again = run(engine, [LONG], PoolingParams())[0]
    assert again.num_cached_tokens > 0
    torch.testing.assert_close(again.outputs.data, finished["a"].outputs.data, atol=1e-5, rtol=1e-5)
    assert engine.get_stats().num_used_blocks == 0
    engine.shutdown()


def test_generation_engine_refuses_pooling_and_back(tiny_llama):
    with LLM(tiny_llama, **BASE) as llm:
        with pytest.raises(ParamError, match="--runner pooling") as e:
            llm.embed({"prompt_token_ids": [5, 6, 7]})
        assert e.value.field == "runner" and tiny_llama in str(e.value)
        assert llm.llm_engine.get_supported_tasks() == ("generate",)
        with pytest.raises(ParamError, match="--runner pooling"):
            llm.llm_engine.add_request("x", [5, 6], PoolingParams(task="classify"))
        assert llm.llm_engine.get_num_unfinished_requests() == 0
    with LLM(tiny_llama, runner="pooling", **BASE) as llm:
        with pytest.raises(ParamError, match="--runner generate") as e:
            llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
        assert e.value.field == "runner"


def test_pooling_prompt_limits_and_truncation(tiny_llama):
    with LLM(tiny_llama, runner="pooling", **BASE) as llm:
        # a pooling prompt may fill max_model_len (nothing is generated after it), not exceed it
        assert len(llm.embed({"prompt_token_ids": list(range(3, 67))}, use_tqdm=False)[0].outputs.embedding) == 256
        with pytest.raises(ParamError, match="max_model_len is 64") as e:
            llm.embed({"prompt_token_ids": list(range(3, 68))})
        assert e.value.field == "prompt"
        cut = llm.embed({"prompt_token_ids": list(range(3, 90))}, truncate_prompt_tokens=10, use_tqdm=False)[0]
        tail = llm.embed({"prompt_token_ids": list(range(80, 90))}, use_tqdm=False)[0]
        assert cut.prompt_token_ids == list(range(80, 90))
        assert cut.outputs.embedding == pytest.approx(tail.outputs.embedding, abs=1e-6)
        for params, field in ((PoolingParams(task="embed", use_activation=True), "use_activation"),
                              (PoolingParams(task="encode", dimensions=8), "dimensions")):
            with pytest.raises(ParamError) as e:
                llm.encode({"prompt_token_ids": [5, 6]}, params)
            assert e.value.field == field
        assert llm.llm_engine.get_stats().num_used_blocks == 0


def test_convert_reward_on_a_causal_lm(tiny_llama):
    """--convert reward without a classifier: every token's hidden state (what encode returns too)."""
    with LLM(tiny_llama, convert="reward", **BASE) as llm:
        assert llm.llm_engine.pooling.tasks == ("reward", "encode")
        reward = llm.reward({"prompt_token_ids": PROMPTS[2]}, use_tqdm=False)[0].outputs.data
        encode = llm.encode({"prompt_token_ids": PROMPTS[2]}, pooling_task="encode", use_tqdm=False)[0].outputs.data
        with pytest.raises(ParamError, match="not 'embed'"):
            llm.embed("x")
    assert reward.shape == (len(PROMPTS[2]), 256)
    torch.testing.assert_close(reward, encode)


def test_checkpoint_without_lm_head(tmp_path, tiny_llama):
    """A base-model (``LlamaModel``) checkpoint has no LM head: runner auto pools, generate is refused by flag."""
    from transformers import AutoModel

    path = tmp_path / "base"
    AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).save_pretrained(path)
    with pytest.raises(ParamError, match="--runner pooling") as e:
        LLM(str(path), runner="generate", **BASE)
    assert e.value.field == "runner"
    with LLM(str(path), **BASE) as llm:
        with LLM(tiny_llama, runner="pooling", **BASE) as ref:
            want = ref.embed({"prompt_token_ids": LONG}, use_tqdm=False)[0].outputs.embedding
        assert llm.embed({"prompt_token_ids": LONG}, use_tqdm=False)[0].outputs.embedding == pytest.approx(
            want, abs=1e-6)


async def _encode_session(engine) -> None:
    await engine.start()
    outs = [o async for o in engine.encode({"prompt_token_ids": LONG}, PoolingParams(dimensions=8), "e1")]
    assert len(outs) == 1 and outs[0].finished and isinstance(outs[0], PoolingRequestOutput)
    assert outs[0].outputs.data.shape == (8,)
    assert outs[0].outputs.data.norm().item() == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ParamError) as e:  # the engine's refusal raises at the first output
        async for _ in engine.encode([5, 6], PoolingParams(task="classify"), "e2"):
            pass
    assert e.value.field == "task"
    # cancelled before its output: the request is aborted in the engine, nothing stays behind
    gens = [engine.encode({"prompt_token_ids": LONG}, PoolingParams(), f"c{i}") for i in range(4)]
    tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
    await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for g in gens:
        await g.aclose()
    after = [o async for o in engine.encode({"prompt_token_ids": [5, 6, 7]}, PoolingParams(), "after")]
    assert after[0].finished
    # Each replica reports its stats with its own next message (data parallel: the aborts may have gone to a
    # replica other than the one that ran "after"), so wait for them to settle.
    for _ in range(200):
        snapshot = [(s.num_used_blocks, s.num_running, s.num_waiting) for s, _ in engine.replica_stats()]
        if all(x == (0, 0, 0) for x in snapshot):
            break
        await asyncio.sleep(0.05)
    assert all(x == (0, 0, 0) for x in snapshot), snapshot
    assert all(r.num_unfinished() == 0 for r in getattr(engine, "replicas", [engine]))


def test_async_llm_encode(tiny_llama):
    from pagedllm.engine.async_engine import AsyncLLM

    engine = AsyncLLM(EngineConfig(tiny_llama, runner="pooling", max_num_batched_tokens=8, **BASE))
    try:
        asyncio.run(_encode_session(engine))
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_data_parallel_encode(tiny_llama):
    from pagedllm.engine.dp_client import DataParallelEngine

    engine = DataParallelEngine(EngineConfig(tiny_llama, runner="pooling", max_num_batched_tokens=8, **BASE),
                                [None, None])
    try:
        asyncio.run(_encode_session(engine))
    finally:
        engine.shutdown()


def test_lora_adapter_embeddings_match_peft(tiny_llama, tmp_path):
    """A LoRA request pools the adapted model's hidden states (the oracle: peft's model), the base one's without."""
    import torch.nn.functional as F

    from lora_utils import ADAPTERS, peft_model, write_adapter
    from pagedllm.lora.request import LoRARequest

    adapter = write_adapter(tiny_llama, tmp_path / "all4", seed=1, **ADAPTERS["all4"])
    oracle = peft_model(tiny_llama, adapter)
    with torch.no_grad():
        adapted = oracle.base_model.model.model(torch.tensor([LONG])).last_hidden_state[0, -1]
        with oracle.disable_adapter():
            base = oracle.base_model.model.model(torch.tensor([LONG])).last_hidden_state[0, -1]
    assert (adapted - base).abs().max() > 1e-2  # the adapter changes the embedding
    with LLM(tiny_llama, runner="pooling", enable_lora=True, max_lora_rank=8, max_num_batched_tokens=16,
             **BASE) as llm:
        lora = LoRARequest("all4", 1, adapter)
        outs = llm.embed([{"prompt_token_ids": LONG}] * 2, lora_request=[lora, None], use_tqdm=False)
    torch.testing.assert_close(torch.tensor(outs[0].outputs.embedding), F.normalize(adapted, dim=-1), atol=1e-4,
                               rtol=1e-4)
    torch.testing.assert_close(torch.tensor(outs[1].outputs.embedding), F.normalize(base, dim=-1), atol=1e-4,
                               rtol=1e-4)
