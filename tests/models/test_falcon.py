"""Falcon natively (``tiny_models.FALCON_CONFIGS``: grouped ``new_decoder_architecture``, multi-query, and the
per-head sequential layout) vs HF: fp32 logits within 1e-4 through the paged cache, greedy parity through the engine,
and ALiBi Falcon (Falcon-RW: per-head layout, sequential; and multi-query) the same way."""

from __future__ import annotations

import pytest
import torch

from model_parity import assert_engine_parity
from pagedllm.models import load_model
from pagedllm.models.falcon import FalconCausalLM
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, family_dirs, hf_eager, parity_prompts, run_schedule
from tiny_models import FALCON_CONFIGS, make_fallback_model

NAMES = list(FALCON_CONFIGS)
KV_HEADS = {"falcon_new_arch": 2, "falcon_mqa": 1, "falcon_sequential": 10}


@pytest.fixture(scope="module")
def falcon_dirs(tmp_path_factory) -> dict[str, str]:
    return family_dirs(tmp_path_factory, "falcon", NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_falcon_logits_match_hf(falcon_dirs, ref_backend, name):
    path = falcon_dirs[name]
    hf = hf_eager(path)
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, FalconCausalLM)
    assert (ours.num_heads, ours.num_kv_heads, ours.head_size) == (10, KV_HEADS[name], 48)
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(name, run_schedule(ours, ref_backend, prompts, schedule), expected)


@pytest.mark.parametrize("name", NAMES)
def test_falcon_greedy_parity_engine(falcon_dirs, name):
    """>= 32 greedy tokens, batch 8 of lengths 1..37 (past block 16), chunked prefill, prefix hits."""
    llm = assert_engine_parity(falcon_dirs[name], hf_eager(falcon_dirs[name]))
    assert isinstance(llm.llm_engine.model, FalconCausalLM)


ALIBI = {"falcon_rw_alibi": ("falcon_sequential", dict(alibi=True)),  # Falcon-RW: per-head qkv, sequential
         "falcon_mqa_alibi": ("falcon_mqa", dict(alibi=True))}


def _float32_build_alibi_tensor(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """transformers' Falcon ``build_alibi_tensor`` without its bfloat16 product: HF computes ``slope * position`` in
    bfloat16 (as the original Falcon code), which moves fp32 logits by ~5e-3 at position 30; pagedllm (like vLLM)
    keeps the bias in float32, so the oracle is HF's Falcon with only that product in float32."""
    from pagedllm.models.alibi import alibi_slopes

    b, s = attention_mask.shape
    pos = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :].float()
    slopes = alibi_slopes(num_heads).to(attention_mask.device)
    return (slopes[None, :, None] * pos).reshape(b * num_heads, 1, s).to(dtype)


@pytest.fixture
def hf_float32_alibi(monkeypatch):
    monkeypatch.setattr("transformers.models.falcon.modeling_falcon.build_alibi_tensor", _float32_build_alibi_tensor)


@pytest.fixture(scope="module")
def alibi_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("falcon_alibi")
    return {name: make_fallback_model(base, root / name, **kw) for name, (base, kw) in ALIBI.items()}


def test_alibi_slopes_match_hf():
    """The slopes are transformers' ``build_alibi_tensor`` numbers (which rounds them to bfloat16, as the original
    Falcon code did), power-of-two head counts and not; 8 heads: 1/2 .. 1/256 exactly."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    from pagedllm.models.alibi import alibi_slopes

    for heads in (1, 4, 8, 10, 12, 40, 71):
        hf = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32).view(heads, 2)[:, 1]  # slope * position 1
        torch.testing.assert_close(alibi_slopes(heads).bfloat16().float(), hf, rtol=0, atol=0)
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]


@pytest.mark.parametrize("name", list(ALIBI))
def test_falcon_alibi_logits_match_hf(alibi_dirs, ref_backend, hf_float32_alibi, name):
    path = alibi_dirs[name]
    hf = hf_eager(path)
    assert hf.config.alibi
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, FalconCausalLM) and ours.transformer.h[0].self_attention.alibi
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(name, run_schedule(ours, ref_backend, prompts, schedule), expected)


@pytest.mark.parametrize("name", list(ALIBI))
def test_falcon_alibi_greedy_parity_engine(alibi_dirs, hf_float32_alibi, name):
    """The CPU backend's ALiBi (SDPA with a per-head float mask) on the mixed batch: chunked prefill, prefix hits."""
    llm = assert_engine_parity(alibi_dirs[name], hf_eager(alibi_dirs[name]))
    assert llm.llm_engine.backend.capabilities.alibi


def test_falcon_alibi_model_info(alibi_dirs):
    """read_model_info flags ALiBi, so config resolution refuses it on a backend without Capabilities.alibi
    (tests/core/test_backend_contract.py checks that refusal)."""
    from pagedllm.models import load_config
    from pagedllm.models.info import read_model_info

    path = alibi_dirs["falcon_rw_alibi"]
    assert read_model_info(path, load_config(path)).alibi
