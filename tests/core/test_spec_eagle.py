"""EAGLE speculative decoding (docs/spec_decode.md): a tiny EAGLE head written in the EAGLE repo / vLLM on-disk
layout drafts exactly what a dense HF transformers computation of the head drafts from the target's features;
greedy outputs equal plain decoding; a head holding the target's own layer accepts every draft; seeded sampling is
reproducible; preemption (recompute and swap) with prefix caching leaves every block free; the draft's K/V is
counted in the pool budget; and it works behind the server."""

from __future__ import annotations

import json
import random

import openai
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ParamError
from pagedllm.spec_decode.config import SpeculativeConfig
from eagle_utils import DenseEagleOracle, make_bigram_llama, make_eagle_head
from server_utils import API_KEY, ServerProcess, tiny_chat_model, wait_idle
from tiny_models import make_tiny_model

BASE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=256)


def _eagle(head: str, k: int = 3, **kw) -> dict:
    """disable_by_batch_size 0: no batch throttle, so what a test counts does not depend on timing."""
    return {"method": "eagle", "model": head, "num_speculative_tokens": k, "disable_by_batch_size": 0, **kw}


def _prompts(n: int, seed: int = 0) -> list[dict]:
    """Random prompts sharing a common 20-token prefix every other time (prefix-cache hits)."""
    rng = random.Random(seed)
    common = [rng.randrange(3, 500) for _ in range(20)]
    return [{"prompt_token_ids": (common if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))]}
            for i in range(n)]


def _ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def heads(tiny_llama, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("eagle")
    bigram = make_bigram_llama(d / "bigram")
    near = make_bigram_llama(d / "near", o_scale=0.005)
    return {"random": make_eagle_head(tiny_llama, d / "random_head"), "bigram": bigram, "near": near,
            "bigram_head": make_eagle_head(bigram, d / "bigram_head", copy_layer=True),
            "near_head": make_eagle_head(near, d / "near_head", copy_layer=True)}


def test_eagle_config_errors_name_the_field(tiny_llama, heads, tmp_path):
    c = SpeculativeConfig.parse(_eagle("/x", 2))
    assert (c.method, c.model, c.num_speculative_tokens) == ("eagle", "/x", 2)
    with pytest.raises(ParamError, match="speculative_config.model"):
        SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ParamError, match="speculative_config.method.*eagle3"):
        SpeculativeConfig.parse({"method": "eagle3", "model": "/x", "num_speculative_tokens": 2})
    with pytest.raises(ParamError, match="speculative_config.model"):  # missing folder
        LLM(tiny_llama, **BASE, speculative_config=_eagle(str(tmp_path / "missing")))
    with pytest.raises(ParamError, match="speculative_config.model.*fc.weight"):  # a plain model, not a head
        LLM(tiny_llama, **BASE, speculative_config=_eagle(tiny_llama))
    other = make_eagle_head(make_tiny_model("llama", tmp_path / "t", hidden_size=128), tmp_path / "h")
    with pytest.raises(ParamError, match="speculative_config.model.*hidden_size"):
        LLM(tiny_llama, **BASE, speculative_config=_eagle(other))


def test_eagle_drafts_equal_dense_hf_oracle_and_greedy_parity(tiny_llama, heads):
    """Every proposal the paged head makes (catch-up over the target's verified features, then its own features,
    over its own paged K/V) equals the dense HF computation of the head on the full context; outputs equal plain
    decoding and every block is free at the end."""
    prompts = _prompts(6)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = _ids(LLM(tiny_llama, **BASE).generate(prompts, sp, use_tqdm=False))
    llm = LLM(tiny_llama, **BASE, enable_prefix_caching=True,
              speculative_config=_eagle(heads["random"], acceptance_threshold=0.0))
    prop = llm.llm_engine.worker.draft_proposer
    seen: list[tuple[list[int], list[int]]] = []
    inner = prop.propose

    def observed(reqs, ks):  # records (context, drafts): the proposer itself runs unchanged
        ctx = [list(r.all_token_ids) for r in reqs]
        out = inner(reqs, ks)
        seen.extend((c, d) for c, d in zip(ctx, out) if d)
        return out

    prop.propose = observed
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
    oracle = DenseEagleOracle(tiny_llama, heads["random"])
    assert len(seen) > 50
    assert [d for _, d in seen] == [oracle.drafts(c, len(d)) for c, d in seen]
    st = llm.llm_engine.get_stats()
    assert st.spec_decode_num_draft_tokens == sum(len(d) for _, d in seen)
    assert st.num_used_blocks == 0 and st.prefix_hits > 0


def test_eagle_drafts_stay_exact_across_swap_and_recompute_preemption(tiny_llama, heads):
    """A pool too small for the batch: requests are swapped out and in (the head's K/V with them) or recomputed
    (the head catches up on the recomputed features); every proposal still equals the dense oracle's."""
    prompts = _prompts(16, seed=5)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    pool = dict(BASE, max_model_len=64, num_gpu_blocks_override=10, block_size=8, max_num_seqs=8, swap_space=0.0001,
                enable_prefix_caching=False)
    llm = LLM(tiny_llama, **pool, speculative_config=_eagle(heads["random"], 2, acceptance_threshold=0.0))
    prop = llm.llm_engine.worker.draft_proposer
    seen: list[tuple[list[int], list[int]]] = []
    inner = prop.propose

    def observed(reqs, ks):
        ctx = [list(r.all_token_ids) for r in reqs]
        out = inner(reqs, ks)
        seen.extend((c, d) for c, d in zip(ctx, out) if d)
        return out

    prop.propose = observed
    llm.generate(prompts, sp, use_tqdm=False)
    st = llm.llm_engine.get_stats()
    assert st.num_swaps > 0 and st.num_preemptions > st.num_swaps  # both kinds happened
    oracle = DenseEagleOracle(tiny_llama, heads["random"])
    assert [d for _, d in seen] == [oracle.drafts(c, len(d)) for c, d in seen]
    assert st.num_used_blocks == 0


def test_eagle_head_with_the_targets_layer_accepts_everything(heads):
    """Target: one layer with zero attention output (its next token depends on the last token only). Head: fc
    reads the token embedding, layer = the target's. Its drafts are the target's tokens: acceptance is exactly
    1.0 and outputs equal plain decoding."""
    prompts = _prompts(6, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _ids(LLM(heads["bigram"], **BASE).generate(prompts, sp, use_tqdm=False))
    llm = LLM(heads["bigram"], **BASE, speculative_config=_eagle(heads["bigram_head"], 4))
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
    st = llm.llm_engine.get_stats()
    assert st.spec_decode_num_draft_tokens > 100 and st.spec_decode_acceptance_rate == 1.0
    assert st.num_used_blocks == 0


def _mixed(num: int, seed: int) -> tuple[list[dict], list[SamplingParams]]:
    prompts = _prompts(num, seed=seed)
    rng = random.Random(seed)
    params = []
    for i in range(num):
        mt = rng.randrange(1, 24)
        if i % 4 < 2:
            params.append(SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True))
        elif i % 4 == 2:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=mt, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=1.0, n=2, seed=i, max_tokens=mt, ignore_eos=True))
    return prompts, params


def test_eagle_seeded_sampling_reproducible(heads):
    prompts, params = _mixed(12, seed=4)
    llm = LLM(heads["near"], **BASE, speculative_config=_eagle(heads["near_head"]))
    first = _ids(llm.generate(prompts, params, use_tqdm=False))
    assert _ids(llm.generate(prompts[::-1], params[::-1], use_tqdm=False))[::-1] == first  # other batch order
    st = llm.llm_engine.get_stats()
    assert st.spec_decode_num_accepted_tokens > 0 and st.num_used_blocks == 0


@pytest.mark.slow
def test_eagle_200_mixed_requests_with_preemption_free_every_block(heads):
    """200 greedy / seeded top-p / n=2 requests through a pool far too small for them, prefix caching on,
    recompute and swap preemption (the head's K/V swaps with the target's): greedy outputs equal plain decoding,
    lengths are exact, drafts are partly accepted, and every block (device and host) is free at the end."""
    pool = dict(BASE, num_gpu_blocks_override=24, block_size=16, max_num_seqs=16, swap_space=0.001)
    prompts, params = _mixed(200, seed=3)
    ref = _ids(LLM(heads["near"], **pool).generate(prompts, params, use_tqdm=False))
    llm = LLM(heads["near"], **pool, speculative_config=_eagle(heads["near_head"], acceptance_threshold=0.0))
    got = _ids(llm.generate(prompts, params, use_tqdm=False))
    eng = llm.llm_engine
    st = eng.get_stats()
    assert st.num_preemptions > 0 and st.num_swaps > 0 and st.prefix_hits > 0
    assert 0.1 < st.spec_decode_acceptance_rate < 1.0
    greedy = [i for i in range(200) if i % 4 < 2]
    assert [got[i] for i in greedy] == [ref[i] for i in greedy]
    assert all(len(c) == p.max_tokens for i, p in enumerate(params) for c in got[i])
    assert eng.kv.num_used_blocks == 0 and eng.kv.num_free_blocks == eng.num_blocks
    assert eng.scheduler.swap.num_free == eng.scheduler.swap.num_blocks
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_draft_kv_is_counted_in_the_pool_budget(tiny_llama, heads):
    """With kv_cache_memory fixed, a draft model / EAGLE head shrinks the target's pool by its bytes per block."""
    from pagedllm.backend.hookspec import KVCacheSpec

    mem = 4 << 20
    kw = dict(BASE, kv_cache_memory=mem)

    def bpb(model, block_size: int) -> int:
        return KVCacheSpec(model.num_layers, 1, block_size, model.num_kv_heads, model.head_size, torch.float32,
                           "cpu").bytes_per_block

    plain = LLM(tiny_llama, **kw).llm_engine
    target = bpb(plain.worker.model, plain.worker.block_size)
    assert plain.num_blocks == mem // target
    for spec in ({"model": tiny_llama, "num_speculative_tokens": 2}, _eagle(heads["random"], 2)):
        eng = LLM(tiny_llama, **kw, speculative_config=spec).llm_engine
        w = eng.worker
        draft = bpb(w.draft_model, w.block_size)
        assert eng.num_blocks == mem // (target + draft) < plain.num_blocks
        assert eng.kv.num_free_blocks == eng.num_blocks
        assert w.draft_model.kv_caches[0].shape[0] == w.kv_caches[0].shape[0]  # the same block ids


def test_eagle_over_the_server(tmp_path):
    """The real openai client against ``pagedllm serve --speculative-config`` with an EAGLE head: greedy output
    equals offline plain decoding, drafts are counted in /metrics, no block stays used."""
    model = tiny_chat_model()
    head = make_eagle_head(model, tmp_path / "head")
    prompt = "one two three four five six seven eight"
    ref = LLM(model, device="cpu").generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                            use_tqdm=False)[0].outputs[0].text
    srv = ServerProcess(model, "--speculative-config", json.dumps(_eagle(head, 3, acceptance_threshold=0.0)))
    try:
        client = openai.OpenAI(base_url=srv.url_v1, api_key=API_KEY, max_retries=0, timeout=60)
        out = client.completions.create(model=srv.served_name, prompt=prompt, max_tokens=20, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == ref and out.usage.completion_tokens == 20
        m = wait_idle(srv.base_url)
        assert m["pagedllm:spec_decode_num_drafts_total"] > 0 and m["pagedllm:kv_cache_used_blocks"] == 0
    finally:
        srv.stop()


@pytest.mark.slow
def test_smollm2_with_a_random_eagle_head_equals_plain_decoding(tmp_path):
    """EAGLE on the real model: a random one-layer head in SmolLM2's shapes (hidden 576, 9 / 3 heads, vocab 49152)
    proposes nonsense, every proposal is verified by SmolLM2, and greedy output equals plain decoding (a logprobs
    request, which never speculates, on the same engine). Throttles off so the head really drafts every step."""
    from safetensors.torch import save_file

    from pagedllm.bench.spec_workload import repeat_prompts
    from pagedllm.models import load_config
    from pagedllm.models.paths import default_model_path

    cfg = load_config(default_model_path()).to_dict()
    cfg.update(num_hidden_layers=1, architectures=["EagleLlamaForCausalLM"], model_type="llama")
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (h, 2 * h), "layers.0.self_attn.q_proj.weight": (h, h),
              "layers.0.self_attn.k_proj.weight": (kv, h), "layers.0.self_attn.v_proj.weight": (kv, h),
              "layers.0.self_attn.o_proj.weight": (h, h), "layers.0.mlp.gate_proj.weight": (i, h),
              "layers.0.mlp.up_proj.weight": (i, h), "layers.0.mlp.down_proj.weight": (h, i)}
    tensors = {k: 0.05 * torch.randn(s, generator=g) for k, s in shapes.items()}
    tensors["layers.0.post_attention_layernorm.weight"] = torch.ones(h)
    head = tmp_path / "smollm2-eagle"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(head / "model.safetensors"))
    llm = LLM(None, device="cpu", dtype="float32", quantization="none", max_model_len=512,
              kv_cache_memory=64 << 20,
              speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 3,
                                  "acceptance_threshold": 0.0, "disable_by_batch_size": 0})
    prompt = repeat_prompts(llm.get_tokenizer(), 1)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = llm.generate(prompt, sp.clone(logprobs=0), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == ref
    st = llm.llm_engine.get_stats()
    assert st.spec_decode_num_draft_tokens > 0 and st.num_used_blocks == 0
