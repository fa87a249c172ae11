"""The offline API: bad input names its field and leaves the engine serving; seeds reproduce; stop handling."""

from __future__ import annotations

import pytest

from pagedllm import LLM, ParamError, SamplingParams
from pagedllm.backend.registry import BackendError


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=16 << 20)


def ids(n, start=5):
    return {"prompt_token_ids": list(range(start, start + n))}


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_idle(llm):
    eng = llm.llm_engine
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished_requests() and not eng.parents


@pytest.mark.parametrize("prompt, field", [
    ({"prompt_token_ids": []}, "prompt"),
    ("", "prompt"),
    (ids(64), "prompt"),  # max_model_len 64: no room for a generated token
    ({"prompt_token_ids": [1, 2, 10**6]}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, -3]}, "prompt_token_ids"),
    (3.5, "prompt"),
])
def test_bad_prompt_names_field_and_engine_keeps_serving(llm, prompt, field):
    good = llm.generate([ids(5)], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ParamError) as e:
        llm.generate([ids(5), prompt, ids(6)], greedy(), use_tqdm=False)
    assert e.value.field == field and field in str(e.value)
    assert_idle(llm)  # the good prompts queued before the bad one were withdrawn
    assert llm.generate([ids(5)], greedy(), use_tqdm=False)[0].outputs[0].token_ids == good


@pytest.mark.parametrize("kw, field", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(n=0), "n"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
])
def test_bad_sampling_params_name_field(kw, field):
    with pytest.raises(ParamError) as e:
        SamplingParams(**kw)
    assert e.value.field == field and str(e.value).startswith(field)


def test_unknown_device_and_missing_model(tiny_llama, tmp_path):
    with pytest.raises(BackendError, match="no backend named 'nosuchdev'"):
        LLM(tiny_llama, device="nosuchdev")
    with pytest.raises(BackendError, match=r"pip install pagedllm\[cuda\]|not usable"):
        LLM(tiny_llama, device="cuda")
    with pytest.raises(FileNotFoundError, match="model"):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_bad_engine_config_names_field(tiny_llama):
    with pytest.raises(ParamError, match="dtype"):
        LLM(tiny_llama, device="cpu", dtype="float8")
    with pytest.raises(ParamError, match="block_size"):
        LLM(tiny_llama, device="cpu", block_size=12)
    with pytest.raises(ParamError, match="num_gpu_blocks_override"):
        LLM(tiny_llama, device="cpu", max_model_len=512, num_gpu_blocks_override=4)
    with pytest.raises(ParamError, match="max_model_len"):
        LLM(tiny_llama, device="cpu", max_model_len=10**6)


def test_seeded_sampling_reproduces_regardless_of_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([ids(7)], sp, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([ids(9, 40), ids(7), ids(3, 80)],
                         [SamplingParams(temperature=1.0, max_tokens=12), sp, SamplingParams(temperature=0.7)],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other = llm.generate([ids(7)], sp.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone
    assert_idle(llm)


def test_max_tokens_min_tokens_and_stop_token_ids(llm):
    out = llm.generate([ids(5)], greedy(max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    stop_tok = out.token_ids[3]
    first = out.token_ids.index(stop_tok)
    out2 = llm.generate([ids(5)], greedy(max_tokens=6, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out2.token_ids == out.token_ids[: first + 1] and out2.finish_reason == "stop"
    assert out2.stop_reason == stop_tok
    out3 = llm.generate([ids(5)], greedy(max_tokens=6, stop_token_ids=[stop_tok], min_tokens=5),
                        use_tqdm=False)[0].outputs[0]
    assert len(out3.token_ids) >= 5 and stop_tok not in out3.token_ids[:5]
    assert_idle(llm)


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate([ids(60)], greedy(max_tokens=50), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate([ids(5)], greedy(max_tokens=4, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok].rank == 1 and len(lp) == 3
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))
