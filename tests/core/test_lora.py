"""Multi-LoRA against peft (the oracle): fp32 logits within 1e-4 and greedy tokens, per adapter, in batches that mix
adapters and the base model; slot swapping, the prefix cache, preemption and n>1 with adapters; bad adapters."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import hf_oracle
from lora_utils import ADAPTERS, base_model, peft_model, write_adapter
from pagedllm import LLM, LoRARequest, ParamError, SamplingParams

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {name: write_adapter(tiny_llama, root / name, seed=i, **kw) for i, (name, kw) in enumerate(ADAPTERS.items())}


def requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(k),), generator=g).tolist() for k in torch.randint(5, 40, (n,), generator=g)]


def oracle(base: str, adapters: dict[str, str], name, prompt, n=MAX_TOKENS) -> list[int]:
    model = base_model_cached(base) if name is None else peft_model(base, adapters[name])
    return hf_oracle.hf_greedy(model, prompt, n)


_BASES: dict = {}


def base_model_cached(path: str):
    if path not in _BASES:
        _BASES[path] = base_model(path)
    return _BASES[path]


def greedy(n=MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_mixed_batch_logits_match_peft(tiny_llama, adapters):
    """One prefill forward mixing 5 adapters and the base model: every position's fp32 logits within 1e-4 of peft."""
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
              enable_lora=True, max_loras=5, max_lora_rank=16)
    engine = llm.llm_engine
    reqs = requests(adapters)
    names = [None, *reqs, None]
    ps = prompts(len(names), seed=1)
    for i, (name, p) in enumerate(zip(names, ps)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(), lora_request=reqs.get(name))
    sched = engine.scheduler.schedule()
    assert len(sched.scheduled) == len(names)
    runner = engine.worker.runner
    input_ids, positions, meta = runner.prepare(sched.scheduled)
    assert meta.lora_mapping is not None and meta.lora_mapping.num_slots_used == 5
    with torch.inference_mode():
        logits = engine.model.compute_logits(engine.model(input_ids, positions, meta)).float()
    qsl = meta.query_start_loc_cpu
    for i, (name, p) in enumerate(zip(names, ps)):
        model = base_model_cached(tiny_llama) if name is None else peft_model(tiny_llama, adapters[name])
        with torch.inference_mode():
            expected = model(torch.tensor([p])).logits[0].float()
        got = logits[qsl[i]:qsl[i + 1]]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"adapter {name}: {m}")
        if name is not None:  # the adapter really changes the model (else parity would prove nothing)
            with torch.inference_mode():
                base = base_model_cached(tiny_llama)(torch.tensor([p])).logits[0].float()
            assert (expected - base).abs().max() > 1e-2, name
    engine.abort_request([f"r{i}" for i in range(len(names))])
    engine.scheduler.update(sched)


def test_mixed_batch_greedy_matches_peft(tiny_llama, adapters):
    """Generation (prefill + decode, continuous batching) with 5 adapters and the base model in one batch."""
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
              enable_lora=True, max_loras=5, max_lora_rank=16)
    reqs = requests(adapters)
    names = [None, *reqs, None, "qv8", "rs16"]
    ps = prompts(len(names), seed=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy(), use_tqdm=False,
                        lora_request=[reqs.get(n) for n in names])
    for name, p, out in zip(names, ps, outs):
        assert out.outputs[0].token_ids == oracle(tiny_llama, adapters, name, p), name
    assert llm.llm_engine.kv.num_used_blocks == 0


def test_equal_runs_take_the_batched_path_and_match_peft(tiny_llama, adapters):
    """Four adapters x two equal-length prompts, submitted interleaved: the runner groups them by adapter, so the
    prefill and every decode step form adjacent equal runs (the grid a backend may batch in one bmm)."""
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
              enable_lora=True, max_loras=4, max_lora_rank=16)
    reqs = requests(adapters)
    names = [n for _ in range(2) for n in list(reqs)[:4]]
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 500, (11,), generator=g).tolist() for _ in names]
    engine = llm.llm_engine
    for i, (name, p) in enumerate(zip(names, ps)):
        engine.add_request(f"u{i}", {"prompt_token_ids": p}, greedy(), lora_request=reqs[name])
    sched = engine.scheduler.schedule()
    batch = sorted(sched.scheduled, key=lambda s: (s.num_new_tokens != 1, s.request.lora_int_id))
    mapping = engine.worker.runner.prepare(batch)[2].lora_mapping
    assert mapping.uniform is not None and mapping.uniform[1] == 22 and len(mapping.runs) == 4
    engine.abort_request([f"u{i}" for i in range(len(names))])
    engine.scheduler.update(sched)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy(), use_tqdm=False,
                        lora_request=[reqs[n] for n in names])
    for name, p, out in zip(names, ps, outs):
        assert out.outputs[0].token_ids == oracle(tiny_llama, adapters, name, p), name


def test_more_adapters_than_slots(tiny_llama, adapters):
    """max_loras=2, max_cpu_loras=3, 5 adapters: all complete and match peft; swaps and host re-reads counted."""
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3)
    reqs = requests(adapters)
    names = [n for n in reqs for _ in range(2)] + [None]
    ps = prompts(len(names), seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy(), use_tqdm=False,
                        lora_request=[reqs.get(n) for n in names])
    for name, p, out in zip(names, ps, outs):
        assert out.outputs[0].token_ids == oracle(tiny_llama, adapters, name, p), name
    stats = llm.llm_engine.get_stats()
    assert stats.lora_slot_loads >= 5 and stats.lora_slot_evictions >= 3, stats
    assert stats.lora_cpu_evictions >= 2 and stats.lora_disk_loads > 5, stats


def test_prefix_cache_keys_blocks_by_adapter(tiny_llama, adapters):
    """The same long prompt under two adapters and the base: each gets its own output, and no cross-adapter hit."""
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=16, block_size=16)
    reqs = requests(adapters)
    p = prompts(1, seed=4)[0] + prompts(1, seed=5)[0] + list(range(10, 50))
    for name in ("all4", "qv8", None):
        out = llm.generate({"prompt_token_ids": p}, greedy(), use_tqdm=False, lora_request=reqs.get(name))[0]
        assert out.outputs[0].token_ids == oracle(tiny_llama, adapters, name, p), name
    assert llm.llm_engine.get_stats().prefix_hits == 0
    out = llm.generate({"prompt_token_ids": p}, greedy(), use_tqdm=False, lora_request=reqs["qv8"])[0]
    assert llm.llm_engine.get_stats().prefix_hits > 0  # same adapter again: its own blocks are reused
    assert out.outputs[0].token_ids == oracle(tiny_llama, adapters, "qv8", p)


@pytest.mark.parametrize("swap_space", [0.0, 0.01], ids=["recompute", "swap"])
def test_preemption_and_n_with_adapters(tiny_llama, adapters, swap_space):
    """A pool too small for the batch forces preemption (recompute, or swap to host); n=2 samples share the
    adapter."""
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks_override=12,
              block_size=16, enable_lora=True, max_loras=3, max_lora_rank=16, swap_space=swap_space)
    reqs = requests(adapters)
    names = ["qv8", "all4", "rs16", None, "qv8", "all4"]
    ps = [p + list(range(3, 40)) for p in prompts(len(names), seed=6)]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy(n=24), use_tqdm=False,
                        lora_request=[reqs.get(n) for n in names])
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and (stats.num_swaps > 0) == (swap_space > 0)
    for name, p, out in zip(names, ps, outs):
        assert out.outputs[0].token_ids == oracle(tiny_llama, adapters, name, p, 24), name
    two = llm.generate({"prompt_token_ids": ps[0]}, greedy(n=2), use_tqdm=False, lora_request=reqs["rs16"])
    sp = SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ps[1]}, sp, use_tqdm=False, lora_request=reqs["rs16"])[0]
    want = oracle(tiny_llama, adapters, "rs16", ps[1], 6)
    assert [o.token_ids for o in out.outputs] == [want, want]
    assert two[0].outputs[0].token_ids == oracle(tiny_llama, adapters, "rs16", ps[0], 2)


def test_bad_adapters_name_the_problem(tiny_llama, adapters, tmp_path):
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=8 << 20,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    engine = llm.llm_engine
    with pytest.raises(ParamError, match="max_lora_rank.*rank 16 > max_lora_rank 8"):
        engine.add_request("a", [5, 6], greedy(), lora_request=LoRARequest("rs16", 3, adapters["rs16"]))
    with pytest.raises(ParamError, match="does not exist"):
        engine.add_request("b", [5, 6], greedy(), lora_request=LoRARequest("x", 9, str(tmp_path / "missing")))
    bad = tmp_path / "bad"
    shutil.copytree(adapters["qv8"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "embed_tokens"]
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ParamError, match="target_modules.*embed_tokens"):
        engine.add_request("c", [5, 6], greedy(), lora_request=LoRARequest("bad", 10, str(bad)))
    cfg["target_modules"], cfg["use_dora"] = ["q_proj", "v_proj"], True
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ParamError, match="use_dora"):
        engine.add_request("d", [5, 6], greedy(), lora_request=LoRARequest("bad", 10, str(bad)))
    with pytest.raises(ParamError, match="lora_int_id"):
        LoRARequest("zero", 0, adapters["qv8"])
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0
    base = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=8 << 20)
    with pytest.raises(ParamError, match="enable_lora"):
        base.generate([5, 6], greedy(), use_tqdm=False, lora_request=LoRARequest("qv8", 1, adapters["qv8"]))
    # The engine still serves after every refusal.
    out = llm.generate([5, 6, 7], greedy(), use_tqdm=False, lora_request=LoRARequest("qv8", 1, adapters["qv8"]))
    assert out[0].outputs[0].token_ids == oracle(tiny_llama, adapters, "qv8", [5, 6, 7])


def test_qwen2_qkv_bias_adapters_match_peft(tiny_model_dirs, tmp_path):
    """Qwen2 (q/k/v biases; the delta adds on top of the biased fused qkv) with two adapters and the base, mixed."""
    base = tiny_model_dirs["qwen2"]
    ads = {"a": write_adapter(base, tmp_path / "a", seed=7, r=4, lora_alpha=16, target_modules="all-linear"),
           "b": write_adapter(base, tmp_path / "b", seed=8, r=8, lora_alpha=8, use_rslora=True,
                              target_modules=["q_proj", "k_proj", "v_proj", "up_proj"])}
    llm = LLM(base, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    reqs = {"a": LoRARequest("a", 1, ads["a"]), "b": LoRARequest("b", 2, ads["b"])}
    names = ["a", None, "b", "a"]
    ps = prompts(len(names), seed=9)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy(), use_tqdm=False,
                        lora_request=[reqs.get(n) for n in names])
    for name, p, out in zip(names, ps, outs):
        assert out.outputs[0].token_ids == oracle(base, ads, name, p), name


def test_static_backend_refuses_enable_lora(tiny_llama):
    with pytest.raises(ParamError, match="enable_lora"):
        LLM(tiny_llama, device="cpu-static", dtype="float32", max_model_len=128, max_num_seqs=8,
            max_num_batched_tokens=64, enable_lora=True)


def test_beam_search_with_adapter_matches_peft(tiny_llama, adapters):
    """``LLM.beam_search(..., lora_request=...)`` equals HF beam search on the peft model (EOS off on both sides,
    so the algorithms coincide; see test_beam_search.py)."""
    from pagedllm import BeamSearchParams

    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    reqs = requests(adapters)
    name = list(reqs)[0]
    p = prompts(1, seed=9)[0]
    out = llm.beam_search([{"prompt_token_ids": p}], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True),
                          lora_request=reqs[name])[0]
    model = peft_model(tiny_llama, adapters[name])
    with torch.inference_mode():
        hf = model.generate(torch.tensor([p]), num_beams=3, do_sample=False, num_return_sequences=3,
                            max_new_tokens=6, eos_token_id=None, early_stopping=True)
    assert [s.tokens[len(p):] for s in out.sequences] == hf[:, len(p):].tolist()
    assert llm.llm_engine.kv.num_used_blocks == 0
