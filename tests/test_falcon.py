"""Falcon natively (``tiny_models.FALCON_CONFIGS``: grouped ``new_decoder_architecture``, multi-query, and the
per-head sequential layout) vs HF: fp32 logits within 1e-4 through the paged cache, greedy parity through the engine,
and ALiBi Falcon refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_parity import assert_engine_parity
from pagedllm import LLM
from pagedllm.errors import UnsupportedModelError
from pagedllm.models import load_model
from pagedllm.models.falcon import FalconCausalLM
from test_models import CHUNKED, FULL_PREFILL, _prompts, assert_logits_match, run_schedule
from tiny_models import FALCON_CONFIGS, make_fallback_model

NAMES = list(FALCON_CONFIGS)
KV_HEADS = {"falcon_new_arch": 2, "falcon_mqa": 1, "falcon_sequential": 10}


@pytest.fixture(scope="module")
def falcon_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("falcon")
    return {name: make_fallback_model(name, root / name) for name in NAMES}


def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", NAMES)
def test_falcon_logits_match_hf(falcon_dirs, ref_backend, name):
    path = falcon_dirs[name]
    hf = _hf(path)
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, FalconCausalLM)
    assert (ours.num_heads, ours.num_kv_heads, ours.head_size) == (10, KV_HEADS[name], 48)
    prompts = _prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(name, run_schedule(ours, ref_backend, prompts, schedule), expected)


@pytest.mark.parametrize("name", NAMES)
def test_falcon_greedy_parity_engine(falcon_dirs, name):
    """>= 32 greedy tokens, batch 8 of lengths 1..37 (past block 16), chunked prefill, prefix hits."""
    llm = assert_engine_parity(falcon_dirs[name], _hf(falcon_dirs[name]))
    assert isinstance(llm.llm_engine.model, FalconCausalLM)


def test_falcon_alibi_refused(tmp_path):
    path = make_fallback_model("falcon_mqa", tmp_path / "alibi", alibi=True)
    with pytest.raises(UnsupportedModelError, match=r"FalconForCausalLM with alibi=True.*ALiBi"):
        LLM(path, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
