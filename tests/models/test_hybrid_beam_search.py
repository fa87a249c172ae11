"""Beam search on models with recurrent state (issue 28): ``entrypoints/beam_search.py`` runs every beam of every
step as its own request over the beam's whole token list. Prefix caching is off for stateful models, so no beam
shares K/V blocks (or a state slot) with its parent or siblings: each computes its conv / delta-rule state from its
own tokens, and forking needs no state copy. Tiny LFM2 and Qwen3-Next give HF ``generate(num_beams=4)``'s beams
(EOS ignored on our side and disabled in HF, as in tests/core/test_beam_search.py, so the two algorithms coincide),
with cumulative log-probabilities within float noise, and leave no block or slot held."""

from __future__ import annotations

import pytest
import torch

from engine_parity import hf_model
from pagedllm import LLM
from pagedllm.entrypoints.beam_search import beam_search
from pagedllm.sampling_params import BeamSearchParams
from stateful import LFM2, LFM2_VOCAB, QWEN3_NEXT, QWEN3_NEXT_VOCAB
from tiny_models import save_random_model

K, T = 4, 8  # beam width, new tokens
FAMILIES = {"lfm2": (LFM2, LFM2_VOCAB), "qwen3_next": (QWEN3_NEXT, QWEN3_NEXT_VOCAB)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid_beams")
    return {name: save_random_model(cfg, root / name) for name, (cfg, _) in FAMILIES.items()}


def _hf_beams(path: str, prompt: list[int]) -> list[tuple[list[int], float]]:
    with torch.inference_mode():
        out = hf_model(path).generate(torch.tensor([prompt]), num_beams=K, do_sample=False, num_return_sequences=K,
                                      max_new_tokens=T, eos_token_id=None, output_scores=True,
                                      return_dict_in_generate=True, early_stopping=True, length_penalty=1.0)
    return list(zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()))


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_matches_hf(dirs, family):
    path, vocab = dirs[family], FAMILIES[family][1]
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=128, block_size=8, kv_cache_memory=8 << 20)
    eng = llm.llm_engine
    assert not eng.kv.enable_caching  # no block (hence no state) is shared between beams
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (13, 21)]  # several blocks, partial last
    outs = beam_search(llm, [{"prompt_token_ids": p} for p in prompts],
                       BeamSearchParams(beam_width=K, max_tokens=T, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        want = _hf_beams(path, prompt)
        assert [s.tokens[len(prompt):] for s in out.sequences] == [w for w, _ in want]
        for s, (_, hf_score) in zip(out.sequences, want):
            assert s.cum_logprob == pytest.approx(hf_score * T, abs=1e-4)  # HF divides by new tokens**1.0
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished_requests()
    slots = eng.kv.state_slots
    assert slots.num_free == slots.num_slots and not slots.owner
