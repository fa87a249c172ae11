"""Expert parallel across data-parallel replicas (``--data-parallel-size 2 --enable-expert-parallel``, vLLM's DP+EP)
against one engine holding every expert (DP=1, the offline LLM; itself checked against HF in test_moe.py).

Two replica processes, one core and one torch thread each, one gloo group: each loads half of the experts (the tiny
Mixtral's 5 go 3 + 2, Qwen2-MoE's 6 and DeepSeek-V3's 8 routed experts split evenly, read from the replicas'
models), and every MoE layer exchanges tokens between them. Greedy tokens must equal DP=1's and the sampled tokens'
logprobs agree within dist_utils' TP bound (5e-5: each token's expert outputs are summed across the replicas in
another float32 order, as TP's row-parallel partial sums are; measured up to 1.2e-5), both with prompts
spread over both replicas (both step with their own requests) and with every prompt on one replica (the other runs
dummy forwards in lock step), and through the real server with the official openai client.
"""

from __future__ import annotations

import asyncio
import os
import shutil

import httpx
import openai
import pytest
import torch
from dist_utils import TP_LOGITS_ABS
from server_utils import ServerProcess, tiny_chat_model

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.dp_client import DataParallelEngine, split_cpus
from pagedllm.errors import ParamError

MAX_TOKENS = 8
PROMPTS = [[3 + (11 * i + 17 * j) % 490 for j in range(2 + (5 * i) % 19)] for i in range(8)]
EXPERTS = {"mixtral": 5, "qwen2_moe": 6, "deepseek_v3": 8}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    import tiny_models

    root = tmp_path_factory.mktemp("dp_ep_models")
    return {name: tiny_models.make_fallback_model(name, root / name) for name in EXPERTS}


def params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def config(path: str, **kw) -> EngineConfig:
    return EngineConfig(model=path, device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
                        max_num_batched_tokens=32, max_num_seqs=4, skip_tokenizer_init=True, **kw)


def reference(path: str) -> list[tuple[list[int], list[float]]]:
    """DP=1: one engine, every expert; (greedy tokens, each sampled token's logprob) per prompt. Run at one torch
    thread, as each replica is: oneDNN's summation order depends on the thread count, and at two threads DeepSeek-V3's
    sigmoid group routing met a near-tie that picked another expert (a different token, not a logprob drift)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(path, device="cpu", dtype="float32", max_model_len=128, skip_tokenizer_init=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params(), use_tqdm=False)
    finally:
        torch.set_num_threads(saved)
    return [token_logprobs(o.outputs[0]) for o in outs]


def token_logprobs(c) -> tuple[list[int], list[float]]:
    return list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def assert_same(got, want, what: str) -> None:
    for i, ((tokens, lps), (want_tokens, want_lps)) in enumerate(zip(got, want, strict=True)):
        assert tokens == want_tokens, f"{what}: prompt {i}: {tokens} != {want_tokens}"
        worst = max(abs(a - b) for a, b in zip(lps, want_lps))
        assert worst <= TP_LOGITS_ABS, f"{what}: prompt {i}: logprobs differ by {worst:.2e}"


async def generate(dp: DataParallelEngine, prompts, replica=None) -> list:
    """All prompts at once; ``replica``: every one on that replica, else the balancer places them."""
    async def one(i: int, p: list[int]):
        target = dp if replica is None else dp.replicas[replica]
        last = None
        async for out in await target.add_request(f"r{i}-{replica}", {"prompt_token_ids": p}, params()):
            last = out
        return token_logprobs(last.outputs[0])

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


@pytest.mark.parametrize("name", list(EXPERTS))
def test_dp2_expert_parallel_matches_dp1(moe_models, name):
    path = moe_models[name]
    want = reference(path)
    cpus = split_cpus(sorted(os.sched_getaffinity(0)), 2)
    dp = DataParallelEngine(config(path, enable_expert_parallel=True), cpus)
    try:
        assert dp.expert_parallel
        # Each replica's model holds its share of every MoE layer's experts, and together all of them.
        infos = [r.expert_parallel for r in dp.replicas]
        total = EXPERTS[name]
        half = (total + 1) // 2
        assert [i["experts"] for i in infos] == [(0, half), (half, total)]
        for i, info in enumerate(infos):
            assert info["num_experts"] == total and info["local_experts_per_layer"]
            assert set(info["local_experts_per_layer"]) == {(half, total - half)[i]}

        async def run():
            await dp.start()
            spread = await generate(dp, PROMPTS)
            both = [r.num_requests for r in dp.replicas]
            before = [r.stats().dp_dummy_steps for r in dp.replicas]
            one_side = await generate(dp, PROMPTS, replica=0)
            for _ in range(200):  # replica 1's last dummy step reports just after replica 0's final output
                if dp.replicas[0].stats().dp_steps == dp.replicas[1].stats().dp_steps:
                    break
                await asyncio.sleep(0.05)
            return spread, both, before, one_side, [r.stats() for r in dp.replicas]

        spread, both, before, one_side, stats = asyncio.run(run())
    finally:
        dp.shutdown()
    assert all(n > 0 for n in both), both  # the balancer put prompts on both replicas
    assert_same(spread, want, f"{name} DP=2 EP, spread")
    assert_same(one_side, want, f"{name} DP=2 EP, all on replica 0")
    # Lock step: both replicas ran the same forwards; replica 1 had none of the second batch and ran dummies.
    assert stats[0].dp_steps == stats[1].dp_steps > 0
    assert stats[1].dp_dummy_steps - before[1] >= MAX_TOKENS
    assert stats[0].dp_dummy_steps == before[0]  # replica 0 had work in every step of the second batch
    print(f"{name}: {stats[0].dp_steps} lock-step forwards, replica 1 dummies {stats[1].dp_dummy_steps}")


def test_dp_expert_parallel_many_short_waves(moe_models):
    """Waves start and end many times, from either replica or both at once, with requests arriving while a wave
    ends (stale wakes): every request finishes (a replica waiting for a wave the other never runs would hang until
    the timeout) and both replicas ran the same forwards."""
    import random

    rng = random.Random(0)
    dp = DataParallelEngine(config(moe_models["mixtral"], enable_expert_parallel=True, distributed_timeout_s=30),
                            [None, None])

    async def one(i: int, replica: int) -> int:
        sp = SamplingParams(temperature=0, max_tokens=rng.randint(1, 3), ignore_eos=True)
        n = 0
        async for out in await dp.replicas[replica].add_request(f"w{i}", {"prompt_token_ids": PROMPTS[i % 8]}, sp):
            n = len(out.outputs[0].token_ids)
        return n

    async def run():
        await dp.start()
        tasks = []
        for i in range(40):
            tasks.append(asyncio.ensure_future(one(i, rng.randrange(2))))
            await asyncio.sleep(rng.choice([0, 0, 0.005, 0.02, 0.05]))
            if i % 5 == 4:  # 8 bursts: each finishes and the group goes idle, however slow the machine is
                await asyncio.wait_for(asyncio.gather(*tasks), 120)
                await asyncio.sleep(0.3)
        done = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for _ in range(200):
            a, b = (r.stats() for r in dp.replicas)
            if (a.dp_steps, a.dp_waves) == (b.dp_steps, b.dp_waves):
                break
            await asyncio.sleep(0.05)
        return done, [r.stats() for r in dp.replicas]

    try:
        done, stats = asyncio.run(run())
    finally:
        dp.shutdown()
    assert all(n >= 1 for n in done)
    assert stats[0].dp_steps == stats[1].dp_steps > 0
    assert stats[0].dp_waves == stats[1].dp_waves >= 5  # the group went idle and restarted many times
    assert stats[0].dp_dummy_steps > 0 and stats[1].dp_dummy_steps > 0
    print(f"{stats[0].dp_waves} waves, {stats[0].dp_steps} lock-step forwards, dummies "
          f"{stats[0].dp_dummy_steps} + {stats[1].dp_dummy_steps}")


def test_dp_expert_parallel_replica_death_fails_both(moe_models):
    """SIGKILL of one replica mid-generation: the survivor's next exchange fails (gloo sees the closed connection),
    so every in-flight request on both replicas ends with EngineDeadError, and nothing hangs."""
    import signal

    from pagedllm.engine.async_engine import EngineDeadError

    dp = DataParallelEngine(config(moe_models["mixtral"], enable_expert_parallel=True, distributed_timeout_s=30),
                            [None, None])
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def run():
        await dp.start()
        streams = [await r.add_request(f"long{r.index}", {"prompt_token_ids": PROMPTS[1]}, long)
                   for r in dp.replicas]
        first = [await s.__anext__() for s in streams]  # both are generating
        os.kill(dp.replicas[1].pid, signal.SIGKILL)

        async def drain(s):
            try:
                async for _ in s:
                    pass
            except EngineDeadError as e:
                return e
            return None

        return first, await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 60)

    try:
        first, errors = asyncio.run(run())
    finally:
        dp.shutdown(timeout=10)
    assert all(not f.finished for f in first)
    assert all(isinstance(e, EngineDeadError) for e in errors), errors
    assert dp.error is not None and not dp.is_running


def test_dp_expert_parallel_start_failure_stops_the_sibling(moe_models):
    """A replica that fails before the rendezvous (here: pinned to a CPU that does not exist) must not leave the other
    waiting there for the start-up timeout: the start fails at once with the failing replica's own error."""
    import time

    t0 = time.monotonic()
    with pytest.raises(OSError):
        DataParallelEngine(config(moe_models["mixtral"], enable_expert_parallel=True),
                           [None, frozenset({100_000})])
    assert time.monotonic() - t0 < 60


def test_dp_expert_parallel_refusals(moe_models):
    cpus = [None, None]
    dense = tiny_chat_model()
    cases = [(config(dense, enable_expert_parallel=True), "enable_expert_parallel"),
             (config(moe_models["mixtral"], enable_expert_parallel=True, tensor_parallel_size=2),
              "enable_expert_parallel"),
             (config(moe_models["mixtral"], enable_expert_parallel=True, enable_lora=True), "enable_lora")]
    for cfg, field in cases:
        with pytest.raises(ParamError) as e:
            DataParallelEngine(cfg, cpus)
        assert e.value.field == field
    with pytest.raises(ParamError) as e:
        DataParallelEngine(config(moe_models["mixtral"], enable_expert_parallel=True), [None] * 6)
    assert e.value.field == "data_parallel_size"  # 6 replicas, 5 experts


@pytest.mark.slow
def test_serve_dp2_expert_parallel_openai(tmp_path):
    """``pagedllm serve --data-parallel-size 2 --enable-expert-parallel``: concurrent completions through the openai
    client equal one engine's, both replicas served some (per-engine /metrics)."""
    import json

    import tiny_models

    chat = tiny_chat_model()
    with open(os.path.join(chat, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    path = tiny_models.make_fallback_model("mixtral", tmp_path / "mixtral", vocab_size=vocab, hidden_size=96,
                                           head_dim=48, num_attention_heads=2, num_key_value_heads=1)
    for f in os.listdir(chat):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(chat, f), path)
    texts = [f"Prompt number {i} says" for i in range(6)]
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=128)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(texts, sp, use_tqdm=False)]
    srv = ServerProcess(path, "--data-parallel-size", "2", "--enable-expert-parallel", "--dtype", "float32",
                        "--max-model-len", "128", api_key=None)
    try:
        client = openai.AsyncOpenAI(base_url=srv.url_v1, api_key="none", max_retries=0, timeout=60)

        async def ask(t: str) -> str:
            r = await client.completions.create(model="test-model", prompt=t, max_tokens=MAX_TOKENS, temperature=0,
                                                extra_body={"ignore_eos": True})
            return r.choices[0].text

        async def run():
            return await asyncio.gather(*(ask(t) for t in texts))

        got = asyncio.run(run())
        metrics = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    finally:
        srv.stop()
    assert got == want
    served = [line for line in metrics.splitlines() if line.startswith("pagedllm:engine_requests_total")]
    assert len(served) == 2 and all(float(line.split()[-1]) > 0 for line in served), served
