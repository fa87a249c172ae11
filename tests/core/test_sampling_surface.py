"""The OpenAI/vLLM sampling fields beyond temperature and top-p: logit_bias, allowed_token_ids, bad_words and
truncate_prompt_tokens, greedy against HF with its own logits processors as the oracle; bad values raise naming
the field and leave nothing behind."""

from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, NoBadWordsLogitsProcessor, PrefixConstrainedLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from hf_oracle import hf_greedy, hf_greedy_processed
from pagedllm import LLM, ParamError, SamplingParams
from server_utils import tiny_chat_model

N = 8


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_chat_model(), device="cpu", max_model_len=256, kv_cache_memory=32 << 20)


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(tiny_chat_model(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.get_tokenizer().encode("The weather today is")


def _greedy(llm, prompt, **kw) -> list[int]:
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, **kw)
    return list(llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0].token_ids)


def test_logit_bias_forces_and_bans(llm, hf, prompt):
    base = _greedy(llm, prompt)
    assert base == hf_greedy(hf, prompt, N)
    assert _greedy(llm, prompt, logit_bias={42: 100}) == [42] * N  # +100 forces (OpenAI: "exclusive selection")
    bias = {base[0]: -100.0, base[1]: -100.0, 7: 5.5}
    got = _greedy(llm, prompt, logit_bias=bias)
    assert base[0] not in got and base[1] not in got
    want = hf_greedy_processed(hf, prompt, N, [SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})])
    assert got == want


def test_allowed_token_ids(llm, hf, prompt):
    allowed = [11, 42, 300, 1000, 4242]
    got = _greedy(llm, prompt, allowed_token_ids=allowed)
    assert set(got) <= set(allowed)
    proc = PrefixConstrainedLogitsProcessor(lambda _b, _ids: allowed, num_beams=1)
    assert got == hf_greedy_processed(hf, prompt, N, [proc])


def test_bad_words(llm, hf, prompt):
    tok = llm.get_tokenizer()
    base = _greedy(llm, prompt)
    words = [tok.decode(base[1:3]).strip(), tok.decode(base[:1]).strip()]  # a two-token and a one-token word
    got = _greedy(llm, prompt, bad_words=words)
    assert got != base
    ids = []
    for w in words:
        for text in (w, " " + w):
            t = tok.encode(text, add_special_tokens=False)
            if t not in ids:
                ids.append(t)
    assert got == hf_greedy_processed(hf, prompt, N, [NoBadWordsLogitsProcessor(ids, eos_token_id=None)])


def test_truncate_prompt_tokens(llm, prompt):
    long = prompt * 4
    out = llm.generate({"prompt_token_ids": long}, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True,
                                                                   truncate_prompt_tokens=len(prompt)),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt
    assert list(out.outputs[0].token_ids) == _greedy(llm, prompt)


@pytest.mark.parametrize("kw, field", [
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(logit_bias={10 ** 7: 1}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[10 ** 7]), "allowed_token_ids"),
    (dict(bad_words=[" "]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
])
def test_bad_values_raise_naming_the_field(llm, prompt, kw, field):
    with pytest.raises(ParamError) as e:
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(**kw), use_tqdm=False)
    assert e.value.field == field
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests() and eng.kv.num_used_blocks == 0
