"""Speculative decoding end to end (docs/spec_decode.md): n-gram and draft-model proposals verified by the target
give token-identical greedy outputs, survive preemption (recompute and swap), prefix caching, n>1, stop strings,
max_tokens and streaming, and leave every KV block free."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sched.kv_manager import KVCacheManager
from pagedllm.sched.request import Request
from pagedllm.errors import ParamError
from pagedllm.sched.scheduler import Scheduler
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from server_utils import tiny_chat_model
from tiny_models import make_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "acceptance_threshold": 0.0, "disable_by_batch_size": 0}  # never throttle: every step with a match speculates
BASE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=256)


def _prompts(n: int, seed: int = 0) -> list[dict]:
    """Prompts that repeat a random phrase (n-gram proposals find matches) mixed with plain random ones."""
    out = []
    for i in range(n):
        rng = random.Random(seed * 1000 + i)
        phrase = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 12))]
        ids = phrase * rng.randrange(1, 4) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 8))]
        out.append({"prompt_token_ids": ids})
    return out


def _ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory) -> str:
    """A second tiny Llama (other seed, same vocab): a draft that is sometimes wrong."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("draft") / "llama", seed=7)


def test_config_errors_name_the_key():
    with pytest.raises(ParamError, match="speculative_config.num_speculative_tokens"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ParamError, match="speculative_config.method"):
        SpeculativeConfig.parse({"method": "bogus", "num_speculative_tokens": 2})
    with pytest.raises(ParamError, match="speculative_config.prompt_lookup_min"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                                 "prompt_lookup_max": 2})
    with pytest.raises(ParamError, match="speculative_config.model"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ParamError, match="speculative_config.typo"):
        SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}')
    c = SpeculativeConfig.parse('{"model": "/x", "num_speculative_tokens": 3}')  # vLLM: model alone = draft
    assert c.method == "draft_model" and c.model == "/x"
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)


def test_draft_model_errors(tiny_llama, tmp_path):
    with pytest.raises(ParamError, match="speculative_config.model"):
        LLM(tiny_llama, **BASE, speculative_config={"model": str(tmp_path / "missing"), "num_speculative_tokens": 2})
    other = make_tiny_model("llama", tmp_path / "v", vocab_size=256)
    with pytest.raises(ParamError, match="vocab size"):
        LLM(tiny_llama, **BASE, speculative_config={"model": other, "num_speculative_tokens": 2})


def test_static_backend_refuses_speculation(tiny_llama):
    with pytest.raises(ParamError, match="speculative_config"):
        LLM(tiny_llama, device="cpu-static", dtype="float32", max_model_len=128, max_num_seqs=8,
            max_num_batched_tokens=64, skip_tokenizer_init=True, speculative_config=NGRAM)


def test_ngram_proposer_longest_tail_most_recent_match():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]  # most recent earlier "1 2 3"
    assert p.propose([5, 6, 7, 8], 3) == []  # no earlier occurrence of any tail
    assert p.propose([4, 1, 5, 1], 2) == [5, 1]  # falls back to the 1-gram "1"
    assert p.propose([1, 2, 3, 1, 2, 3], 1) == [1]  # capped by k


def test_lookahead_slots_reserved_then_trimmed():
    kv = KVCacheManager(16, 4, enable_caching=True)
    s = Scheduler(kv, 8, 64, 128)
    r = Request("a", list(range(6)), SamplingParams())
    s.add_request(r)
    s.update(s.schedule())
    r.append_token(9)  # 7 tokens, 6 computed: decoding
    r.num_lookahead = 5
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 6 and len(kv.block_ids("a")) == 3  # 12 slots: positions 0..11
    out.scheduled[0].set_proposals([1, 2])  # the proposer found only two
    assert out.scheduled[0].num_new_tokens == 3
    s.update(out)  # computed 9
    r.append_token(1)
    r.append_token(4)  # one draft accepted, then the target's token: 9 tokens
    s.rollback(r, 1)
    assert r.num_computed_tokens == 8 and len(kv.block_ids("a")) == 3  # 9 tokens need 3 blocks of 4
    r.num_lookahead = 0
    s.finish(r, r.status.FINISHED_ABORTED)
    assert kv.num_free_blocks == 16


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_ngram_matches_plain_decoding(tiny_model_dirs, arch):
    model = tiny_model_dirs[arch]
    prompts = _prompts(8)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _ids(LLM(model, **BASE).generate(prompts, sp, use_tqdm=False))
    llm = LLM(model, **BASE, speculative_config=NGRAM)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
    st = llm.llm_engine.get_stats()
    assert st.spec_decode_num_drafts > 0 and st.spec_decode_num_accepted_tokens > 0
    assert st.spec_decode_mean_accepted_length == pytest.approx(
        1 + st.spec_decode_num_accepted_tokens / st.spec_decode_num_drafts)
    assert st.num_used_blocks == 0


def test_draft_model_identical_to_target_accepts_everything(tiny_llama):
    prompts = _prompts(6)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _ids(LLM(tiny_llama, **BASE).generate(prompts, sp, use_tqdm=False))
    llm = LLM(tiny_llama, **BASE, speculative_config={"method": "draft_model", "model": tiny_llama,
                                                      "num_speculative_tokens": 3})
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
    st = llm.llm_engine.get_stats()
    assert st.spec_decode_num_draft_tokens > 0
    assert st.spec_decode_acceptance_rate == 1.0
    assert st.num_used_blocks == 0


def test_other_draft_model_greedy_parity(tiny_llama, other_llama):
    prompts = _prompts(6, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _ids(LLM(tiny_llama, **BASE).generate(prompts, sp, use_tqdm=False))
    llm = LLM(tiny_llama, **BASE, speculative_config={"model": other_llama, "num_speculative_tokens": 3,
                                                      "acceptance_threshold": 0.0})
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
    st = llm.llm_engine.get_stats()
    assert 0 < st.spec_decode_num_drafts and st.spec_decode_acceptance_rate < 1.0
    assert st.num_used_blocks == 0


def _mixed(num: int, seed: int) -> tuple[list[dict], list[SamplingParams]]:
    """Greedy, seeded random (top-p) and n=2 random requests of mixed lengths."""
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


SMALL_POOL = dict(BASE, num_gpu_blocks_override=24, block_size=16, max_num_seqs=16, swap_space=0.001)


@pytest.mark.slow
@pytest.mark.parametrize("method,num", [("ngram", 200), ("draft_model", 24)])
def test_mixed_requests_with_preemption_free_every_block(tiny_llama, method, num):
    """Mixed requests through a pool far too small for them, prefix caching on (prompts share phrases), recompute
    and swap preemption: greedy outputs equal plain decoding, lengths are exact, and every block is free at the
    end (device and host pools, nothing left running or waiting)."""
    spec = NGRAM if method == "ngram" else {"model": tiny_llama, "num_speculative_tokens": 3}
    prompts, params = _mixed(num, seed=3)
    ref = _ids(LLM(tiny_llama, **SMALL_POOL).generate(prompts, params, use_tqdm=False))
    llm = LLM(tiny_llama, **SMALL_POOL, speculative_config=spec)
    got = _ids(llm.generate(prompts, params, use_tqdm=False))
    eng = llm.llm_engine
    st = eng.get_stats()
    assert st.num_preemptions > 0 and st.num_swaps > 0, "the pool must force recompute and swap preemption"
    assert st.spec_decode_num_accepted_tokens > 0 and st.prefix_hits > 0
    greedy = [i for i in range(num) if i % 4 < 2]
    assert [got[i] for i in greedy] == [ref[i] for i in greedy]
    for i, p in enumerate(params):
        assert all(len(c) == p.max_tokens for c in got[i])
    assert eng.kv.num_used_blocks == 0 and eng.kv.num_free_blocks == eng.num_blocks
    assert eng.scheduler.swap.num_free == eng.scheduler.swap.num_blocks
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_seeded_sampling_reproducible_under_speculation(tiny_llama):
    prompts, params = _mixed(12, seed=4)
    llm = LLM(tiny_llama, **BASE, speculative_config=NGRAM)
    first = _ids(llm.generate(prompts, params, use_tqdm=False))
    assert _ids(llm.generate(prompts[::-1], params[::-1], use_tqdm=False))[::-1] == first  # other batch order
    assert llm.llm_engine.get_stats().spec_decode_num_drafts > 0


@pytest.fixture(scope="module")
def chat_model() -> str:
    return tiny_chat_model()


def test_stop_strings_max_tokens_and_streaming_with_multi_token_steps(chat_model):
    """A step may emit several tokens: stop strings cut inside them, max_tokens is exact, and a delta stream
    concatenates to the final output."""
    kw = dict(device="cpu", dtype="float32", max_model_len=256)
    plain = LLM(chat_model, **kw)
    llm = LLM(chat_model, **kw, speculative_config=NGRAM)
    prompt = "one two three four five six seven eight one two three four five six seven eight one two"
    greedy = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True)
    full = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    assert full.token_ids == plain.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(full.token_ids) == 37
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
    # A stop string taken from the middle of the greedy text.
    words = full.text.split()
    stop = " ".join(words[len(words) // 2:len(words) // 2 + 2])
    sp = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, stop=[stop])
    a = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    b = plain.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, b.finish_reason,
                                                                     b.stop_reason)
    assert a.finish_reason == "stop" and stop not in a.text
    # Streaming: delta outputs through the engine.
    eng = llm.llm_engine
    eng.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, output_kind="delta"))
    toks, text, steps = [], "", 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            toks += out.outputs[0].token_ids
            text += out.outputs[0].text
            steps += 1
    assert toks == full.token_ids and text == full.text
    assert steps < 37  # some steps carried several tokens
    assert eng.kv.num_used_blocks == 0


def test_smollm2_greedy_parity_ngram():
    """The real model (embedded SmolLM2 GGUF) on a "repeat this passage" prompt. One engine (loading the GGUF is
    the slow part): a request asking for logprobs never speculates, so it is plain decoding with the same weights;
    the same prompt without logprobs speculates and must give the same tokens, accepting most drafts."""
    from pagedllm.bench.spec_workload import repeat_prompts

    llm = LLM(None, device="cpu", dtype="float32", max_model_len=512, kv_cache_memory=32 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
                                  "prompt_lookup_max": 5})
    prompt = repeat_prompts(llm.get_tokenizer(), 1)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = llm.generate(prompt, sp.clone(logprobs=0), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.llm_engine.get_stats().spec_decode_num_drafts == 0  # the reference run did not speculate
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == ref
    st = llm.llm_engine.get_stats()
    assert st.spec_decode_num_drafts > 0 and st.spec_decode_acceptance_rate > 0.5
    assert st.num_used_blocks == 0


@pytest.mark.slow
def test_smollm2_draft_model_identical_to_target_accepts_everything():
    """Draft-model speculation on the real model, the draft being the same SmolLM2 GGUF: every proposal is the
    target's own greedy token, so all are accepted, and the output equals plain decoding (a logprobs request,
    which never speculates, on the same engine)."""
    from pagedllm.bench.spec_workload import repeat_prompts
    from pagedllm.models.paths import default_model_path

    llm = LLM(None, device="cpu", dtype="float32", max_model_len=512, kv_cache_memory=64 << 20,  # target + draft
              speculative_config={"method": "draft_model", "model": default_model_path(),
                                  "num_speculative_tokens": 4})
    prompt = repeat_prompts(llm.get_tokenizer(), 1)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = llm.generate(prompt, sp.clone(logprobs=0), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == ref
    st = llm.llm_engine.get_stats()
    assert st.spec_decode_num_draft_tokens > 0 and st.spec_decode_acceptance_rate == 1.0
    assert st.num_used_blocks == 0
