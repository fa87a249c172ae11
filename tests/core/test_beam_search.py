"""Beam search (pagedllm.entrypoints.beam_search, vLLM's algorithm) against HF transformers' beam search on tiny random models.

The tiny models have no tokenizer, so prompts are token ids. Log-probabilities on both sides are sums of raw
log-softmax values of fp32 logits, so scores agree to float noise (1e-4).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.entrypoints.beam_search import beam_search, get_beam_search_score
from pagedllm.errors import ParamError
from pagedllm.sampling_params import BeamSearchParams

K, T = 4, 10  # beam width, new tokens
PROMPT_LENS = (37, 70)  # not block-aligned, so forks recompute a partial block


@pytest.fixture(scope="module")
def engines(tiny_model_dirs):
    """name -> (pagedllm LLM, HF model), built on first use."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(name: str):
        if name not in cache:
            path = tiny_model_dirs[name]
            llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[name] = (llm, hf)
        return cache[name]

    return get


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_beams(hf, prompt: list[int], eos, **kw) -> list[tuple[list[int], float]]:
    """HF's returned hypotheses as (generated tokens up to and including EOS, sequences_score)."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), num_beams=K, do_sample=False, num_return_sequences=K,
                          max_new_tokens=T, eos_token_id=eos, output_scores=True, return_dict_in_generate=True,
                          **kw)
    beams = []
    for seq, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        if eos is not None and eos in seq:
            seq = seq[:seq.index(eos) + 1]  # HF pads after EOS
        beams.append((seq, score))
    return beams


def _teacher_forced_logprob(hf, tokens: list[int], prompt_len: int) -> float:
    """Sum of log p(token | prefix) over the generated tokens, by one HF forward pass."""
    with torch.inference_mode():
        lps = hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    return sum(float(lps[i - 1, tokens[i]]) for i in range(prompt_len, len(tokens)))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_beam_search_matches_hf(engines, name):
    """Equal to HF ``generate(num_beams=4, early_stopping=True, length_penalty=0.5)`` when no beam can end early.

    Why the two algorithms coincide here: EOS is ignored on our side (``ignore_eos``) and disabled in HF
    (``eos_token_id=None``), so no hypothesis ever finishes before ``max_new_tokens``. Both then keep, every step,
    the top-k continuations by cumulative logprob over all beams (vLLM takes each beam's top 2k and then the top k,
    which contains the global top k; HF takes the global top 2k, all live), and both rank the final k equal-length
    beams by ``cum / len**length_penalty``, i.e. by cum, so early_stopping and length_penalty change nothing.
    (The random llama does emit its EOS id 2 mid-beam with these prompts, so ignore_eos is really exercised.)
    Also checks the KV side: every step's forks hit their prefix blocks in the cache, so each request computes at
    most the tokens after its last full block, and nothing leaks.
    """
    llm, hf = engines(name)
    engine = llm.llm_engine
    prompts = _prompts(seed=0)
    before = engine.get_stats()
    q0, c0, p0, h0 = before.prefix_queries, before.computed_prompt_tokens, before.prompt_tokens, before.prefix_hits
    lp = 0.5
    params = BeamSearchParams(beam_width=K, max_tokens=T, ignore_eos=True, length_penalty=lp)
    outs = beam_search(llm, [{"prompt_token_ids": p} for p in prompts], params)

    for prompt, out in zip(prompts, outs):
        want = _hf_beams(hf, prompt, eos=None, early_stopping=True, length_penalty=lp)
        got = out.sequences
        assert [s.tokens[len(prompt):] for s in got] == [w[0] for w in want]
        for s, (_, hf_score) in zip(got, want):
            assert s.tokens[:len(prompt)] == prompt
            assert s.cum_logprob == pytest.approx(hf_score * T ** lp, abs=1e-4)  # HF divides by new tokens**lp
            assert s.finish_reason == "length" and len(s.logprobs) == T
    if name == "llama":
        assert any(2 in s.tokens[len(p):] for p, o in zip(prompts, outs) for s in o.sequences)

    assert engine.kv.num_used_blocks == 0
    after = engine.get_stats()
    bs = engine.kv.block_size
    # Step 0 submits each prompt once, later steps K beams of length L+t; a request computes at most the tokens
    # past its last full block (its earlier blocks are found in the cache), the first one everything.
    submitted = sum(L + K * sum(L + t for t in range(1, T)) for L in PROMPT_LENS)
    computed_bound = sum(L + K * sum((L + t) - bs * ((L + t - 1) // bs) for t in range(1, T)) for L in PROMPT_LENS)
    assert after.prompt_tokens - p0 == submitted
    assert after.prefix_queries - q0 == submitted
    assert after.prefix_hits - h0 > 0
    assert after.computed_prompt_tokens - c0 <= computed_bound < submitted / 3


def test_beam_search_with_eos(engines):
    """With EOS live (id 2, reachable with these prompts), against HF's canonical beam search and a forward pass.

    vLLM's rule and HF's differ once beams can finish: vLLM completes every EOS continuation among each beam's
    top 2k, HF only those ranked in the top k of the step. With ``length_penalty=0`` and HF's
    ``early_stopping="never"`` (HF's exact, canonical variant) both rank by cum logprob and keep the same live
    beams, so HF's final hypotheses are a subset of vLLM's pool: vLLM's i-th best score is >= HF's, and every HF
    hypothesis scoring above vLLM's k-th is returned. Each returned cum logprob also equals HF's teacher-forced sum.
    """
    llm, hf = engines("llama")
    eos = 2
    prompts = _prompts(seed=0)
    finished_early = 0
    for lp in (0.0, 1.0):
        outs = beam_search(llm, [{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=K, max_tokens=T, length_penalty=lp))
        for prompt, out in zip(prompts, outs):
            got = out.sequences
            assert len(got) == K
            scores = [get_beam_search_score(s.tokens, s.cum_logprob, eos, lp) for s in got]
            assert scores == sorted(scores, reverse=True)
            for s in got:
                gen = s.tokens[len(prompt):]
                assert eos not in gen[:-1]
                assert s.finish_reason == ("stop" if gen[-1] == eos else "length")
                assert len(gen) == T or s.finish_reason == "stop"
                assert s.cum_logprob == pytest.approx(_teacher_forced_logprob(hf, s.tokens, len(prompt)), abs=1e-4)
                finished_early += len(gen) < T
            if lp == 0.0:
                want = _hf_beams(hf, prompt, eos=eos, early_stopping="never", length_penalty=0.0)
                ours = {tuple(s.tokens[len(prompt):]): s.cum_logprob for s in got}
                for mine, theirs in zip(scores, [w[1] for w in want]):
                    assert mine >= theirs - 1e-4
                for seq, score in want:
                    if score > scores[-1] + 1e-4:
                        assert ours.get(tuple(seq)) == pytest.approx(score, abs=1e-4)
    assert finished_early > 0  # EOS really ended some returned beams
    assert llm.llm_engine.kv.num_used_blocks == 0


def test_beam_width_limit(engines):
    """2*beam_width logprobs must fit SamplingParams' limit of 20, so the error names beam_width."""
    llm, _ = engines("llama")
    with pytest.raises(ParamError) as e:
        beam_search(llm, [{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(beam_width=11, max_tokens=2))
    assert e.value.field == "beam_width"


def test_beam_search_follows_structured_outputs():
    """Every beam of a JSON-schema and a regex beam search stays on the grammar: a finished beam's text validates,
    an unfinished one is a prefix the grammar accepts; masked tokens never become candidates."""
    import json

    import jsonschema
    import xgrammar as xgr

    from pagedllm import StructuredOutputsParams
    from server_utils import tiny_chat_model
    from structured_schemas import SCHEMAS

    llm = LLM(tiny_chat_model(), device="cpu", max_model_len=256, kv_cache_memory=32 << 20)
    tok = llm.get_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=llm.llm_engine.model.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    schema = SCHEMAS[1]
    cases = [(StructuredOutputsParams(json=schema), compiler.compile_json_schema(json.dumps(schema)),
              lambda text: jsonschema.validate(json.loads(text), schema)),
             (StructuredOutputsParams(regex=r"[A-Z]{2}-[0-9]{3}"), compiler.compile_regex(r"[A-Z]{2}-[0-9]{3}"),
              lambda text: __import__("re").fullmatch(r"[A-Z]{2}-[0-9]{3}", text) or pytest.fail(text))]
    for spec, compiled, check in cases:
        outs = llm.beam_search(["Record:", "Another one:"], BeamSearchParams(beam_width=3, max_tokens=60,
                                                                            structured_outputs=spec))
        for out in outs:
            assert len(out.sequences) == 3
            for s in out.sequences:
                prompt_len = len(s.tokens) - len(s.logprobs)
                matcher = xgr.GrammarMatcher(compiled)
                assert all(matcher.accept_token(t) for t in s.tokens[prompt_len:]), s.tokens
                if s.finish_reason == "stop":  # ended on EOS; text (as vLLM's) includes the prompt
                    check(tok.decode(s.tokens[prompt_len:-1]))
            assert any(s.finish_reason == "stop" for s in out.sequences)
    assert llm.llm_engine.kv.num_used_blocks == 0
