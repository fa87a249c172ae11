"""The transformers fallback (``--model-impl``): HF's module with pagedllm's paged attention, vs HF itself.

Odd shapes in ``tiny_models.FALLBACK_CONFIGS`` (Phi-3, Gemma 2, GLM, OLMo 2, Starcoder2), forced through the fallback:
fp32 logits within 1e-4 of HF through the paged cache (full prefill, and chunks beside decodes). OLMo 2 and
Starcoder2, which have no native decoder, take the fallback under ``auto`` and pass greedy parity through the whole
engine. Llama
through ``--model-impl transformers`` matches the native path. Unrunnable models fail naming the architecture and
what is supported.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig

from model_parity import assert_engine_parity, engine_outputs, mixed_batch
from pagedllm import LLM
from pagedllm.errors import UnsupportedModelError
from pagedllm.models import load_model
from pagedllm.models.arch import resolve_model_impl
from pagedllm.models.transformers_impl import TransformersCausalLM
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, family_dirs, hf_eager, parity_prompts, run_schedule
from tiny_models import FALLBACK_CONFIGS


@pytest.fixture(scope="module")
def fallback_dirs(tmp_path_factory) -> dict[str, str]:
    return family_dirs(tmp_path_factory, "fallback_models", FALLBACK_CONFIGS)


@pytest.mark.parametrize("name", list(FALLBACK_CONFIGS))
def test_fallback_logits_match_hf(fallback_dirs, ref_backend, name, caplog):
    path = fallback_dirs[name]
    hf = hf_eager(path)
    with caplog.at_level(logging.INFO, logger="pagedllm.models.loader"):
        ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"),
                          model_impl="transformers")
    assert isinstance(ours, TransformersCausalLM)
    assert [r.getMessage() for r in caplog.records if "implementation" in r.getMessage()] == [
        f"model {hf.config.architectures[0]}: transformers implementation (transformers' module, pagedllm paged "
        "attention)"]
    assert (ours.num_heads, ours.num_kv_heads) == (10, 2) and ours.head_size == 48
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(name, run_schedule(ours, ref_backend, prompts, schedule), expected)


@pytest.mark.parametrize("name", ["olmo2", "starcoder2"])
def test_fallback_greedy_parity_engine(fallback_dirs, name):
    """>= 32 greedy tokens, batch 8 of lengths 1..37 (past block 16 and window 8), chunked prefill, prefix hits."""
    path = fallback_dirs[name]
    llm = assert_engine_parity(path, hf_eager(path))
    assert isinstance(llm.llm_engine.model, TransformersCausalLM)


def test_llama_transformers_impl_matches_native(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    hf = hf_eager(path)
    llm = assert_engine_parity(path, hf, model_impl="transformers")
    assert isinstance(llm.llm_engine.model, TransformersCausalLM)
    native = LLM(path, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
                 max_num_batched_tokens=16, model_impl="native")
    assert type(native.llm_engine.model).__name__ == "CausalLM"
    first, _ = mixed_batch(hf.config.vocab_size)
    assert engine_outputs(native, first) == engine_outputs(llm, first)


def test_model_impl_resolution():
    llama = AutoConfig.for_model("llama", architectures=["LlamaForCausalLM"])
    olmo2 = AutoConfig.for_model("olmo2", architectures=["Olmo2ForCausalLM"])
    assert resolve_model_impl(llama) == ("LlamaForCausalLM", "native")
    assert resolve_model_impl(llama, "transformers") == ("LlamaForCausalLM", "transformers")
    assert resolve_model_impl(olmo2) == ("Olmo2ForCausalLM", "transformers")
    with pytest.raises(UnsupportedModelError, match="Olmo2ForCausalLM.*supports LlamaForCausalLM"):
        resolve_model_impl(olmo2, "native")


@pytest.mark.parametrize("config, message", [
    (dict(model_type="t5", architectures=["T5ForConditionalGeneration"]), "T5ForConditionalGeneration is an "
                                                                           "encoder-decoder model"),
    (dict(model_type="llama", architectures=["BaichuanForCausalLM"]), "BaichuanForCausalLM.*no decoder-only"),
    (dict(model_type="distilbert", architectures=["DistilBertModel"]), "DistilBertModel.*no decoder-only"),
    (dict(model_type="bloom", architectures=["BloomForCausalLM"]), "BloomForCausalLM does not route attention"),
])
def test_unrunnable_models_name_the_architecture(config, message):
    kwargs = dict(config)
    cfg = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with pytest.raises(UnsupportedModelError, match=message) as e:
        resolve_model_impl(cfg)
    assert "pagedllm supports LlamaForCausalLM" in str(e.value)


def test_model_impl_flag_is_validated():
    from pagedllm.cli import build_parser
    from pagedllm.commands.engine_args import engine_config
    from pagedllm.config import EngineConfig
    from pagedllm.errors import ParamError

    with pytest.raises(ParamError, match="model_impl"):
        EngineConfig(model_impl="vllm")
    args = build_parser().parse_args(["generate", "hi", "--model-impl", "transformers"])
    assert engine_config(args).model_impl == "transformers"
    assert engine_config(build_parser().parse_args(["generate", "hi"])).model_impl == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--model-impl", "vllm"])


def test_remote_code_only_layout_is_refused_naming_it(tmp_path):
    import json

    from pagedllm.models import load_config

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["InternLMForCausalLM"], "model_type": "internlm",
        "auto_map": {"AutoModelForCausalLM": "modeling_internlm.InternLMForCausalLM"}}))
    with pytest.raises(UnsupportedModelError, match=r"InternLMForCausalLM \(model_type 'internlm'\) \(remote code.*"
                                                    r"supports LlamaForCausalLM"):
        load_config(str(tmp_path))
